"""Attention and elementwise ops for the engine, each in two implementations with one contract.

`pdserve.kernels.reference` holds the pure-torch versions (the CPU path, and the oracle for tests);
`kernels.triton_*` hold the Triton kernels the CUDA path uses (they also run on CPU under
`TRITON_INTERPRET=1`). `pdserve.kernels.ops.get_ops(name)` returns one implementation by name.
"""
