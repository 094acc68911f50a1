"""A worked example of a plugserve attention backend in plain PyTorch (see docs/backends.md)."""
