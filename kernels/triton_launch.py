"""Launch buckets of the Triton attention kernels (kernels/triton_attention.py), in a module
that does not import triton, so the engine can plan its warm-up without it."""

DECODE_MAX_SPLITS = 32  # decode split-K: a power of two up to this
DECODE_MIN_SPLIT_KEYS = 256  # a split gets at least this many keys
PREFILL_BLOCK_M = (16, 64)  # query rows per prefill program: chunks <= 32 rows, longer
