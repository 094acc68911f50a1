"""CPU kernels compiled on the machine that runs them (see `plugserve.kernels.build`)."""
