"""Block-quantized weights (GGML's formats) kept as they are stored: the type table, the
weight object the model's linear and embedding layers dispatch on, and the pure-torch
reference every kernel is tested against."""
