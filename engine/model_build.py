"""Building a model for an engine: its device, its uninitialised weights, the packed forms
of its loaded weights, the KV bytes a block costs (engine/model_runner.py loads the
weights and runs the model)."""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from pdserve.common.errors import ConfigError
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_arch import ModelArch
from pdserve.engine.models import get_model_class
from pdserve.engine.models.cpu_linear import cpu_amx, onednn_amx, onednn_available
from pdserve.engine.models.fused_decode import FusedDecode
from pdserve.kernels import ops as kernel_ops
from pdserve.kernels.ops import GEMV_MAX_ROWS, packed_bf16_amx

logger = logging.getLogger(__name__)


def kv_bytes_per_block(arch: ModelArch, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return arch.num_hidden_layers * 2 * block_size * arch.num_key_value_heads * arch.head_dim * elem


def build_model(arch: ModelArch, ops: ModuleType, device: torch.device, dtype: torch.dtype):
    """The model with uninitialised weights, allocated once on `device` in `dtype`.

    Built under the meta device and cast there, so no fp32 copy of the weights ever
    exists on the device (on a GPU that would double the memory needed to load).
    """
    with torch.device("meta"):
        model = get_model_class(arch.architectures)(arch, ops)
    model.to(dtype)
    # `to_empty` would do, but its empty_like of meta tensors first imports much of torch's
    # Python decompositions (~5 s of CPU at an engine start); plain `empty` imports nothing
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # tied tensors stay one

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:  # (the meta tensor is kept: its id is not reused meanwhile)
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, t.requires_grad)
            made[id(t)] = (t, new)
        return made[id(t)][1]

    for module in model.modules():
        for group in (module._parameters, module._buffers):
            for name, t in group.items():
                if t is not None:
                    group[name] = empty(t)
    return model


def resolve_device(name: str) -> torch.device:
    """`cpu`, or `cuda[:N]` with the index filled in and checked against this machine."""
    device = torch.device(name)
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise ConfigError("model.device", f"{name!r}: no CUDA device on this machine")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ConfigError(
            "model.device", f"{name!r}: this machine has {torch.cuda.device_count()} GPU(s)"
        )
    return torch.device("cuda", index)


def prompt_gemm_form(setting: str, dtype: torch.dtype) -> str:
    """`model.prompt_gemm` for this CPU: `onednn` or `panel` as set; `auto` the panel copies
    where their GEMM measured about as fast as oneDNN's at prompt row counts (or faster than
    what runs instead), so each projection is held once:
    - an AVX-512 build on a CPU without AMX, fp32, or bf16 on the CPU's bf16 dot products
      (Zen 4, `benchmarks/weight_forms.py`: 0.86-0.97x oneDNN's time at 64-4096 rows in
      fp32, 0.93-1.04x in bf16; workload C as fast: docs/benchmarks.md, "One form");
    - an AVX2 build (no AVX-512), fp32 and bf16: with the CPU held to AVX2
      (`scripts/avx2_cap.sh` on Zen 4; docs/benchmarks.md, "One form on AVX2") fp32
      workloads B and C ran as fast within the runs' noise (C 0.95x-1.08x, B 1.07x by the
      medians of 8-16 runs), the engine ~0.5 GB smaller; bf16, which oneDNN does not pack
      without AVX-512, 3.3x as fast in C as the bf16 GEMM that runs instead.
    Elsewhere oneDNN's: on a Xeon with AMX the panels were 3-17 % slower in fp32 and bf16
    runs on oneDNN's AMX kernels; bf16 on AVX-512 without its dot products, and the plain
    C++ build, are not measured."""
    if setting != "auto":
        return setting
    bits = kernel_ops.packed_vector_bits()
    if cpu_amx() or bits not in (256, 512):
        return "onednn"
    if dtype == torch.float32:
        return "panel"
    if dtype == torch.bfloat16 and (bits == 256 or kernel_ops.packed_bf16_native()):
        return "panel"
    return "onednn"


def pack_weights(
    model: torch.nn.Module,
    config: EngineConfig,
    arch: ModelArch,
    device: torch.device,
    dtype: torch.dtype,
    single_device: bool,
) -> None:
    """The packed forms of the model's weights for this box, chosen once at load: oneDNN's
    prepacked copies for prompt steps (or, with `model.prompt_gemm: panel`, the batched
    forward's panels), the fused native decode (engine/models/fused_decode.py), and the
    plain projection weights freed where the packed copies hold them all."""
    mc = config.model
    # model.prompt_gemm "panel" (or "auto" on a CPU where it resolves so): prompt steps on
    # the batched forward's panel copies, no oneDNN copy (below); not for TP ranks or the
    # compiled step (oneDNN's as before)
    form = prompt_gemm_form(mc.prompt_gemm, dtype) if device.type == "cpu" else "onednn"
    panels = form == "panel" and single_device and not mc.compiled
    if mc.prompt_gemm == "panel" and device.type == "cpu" and not panels:
        logger.info("prompt_gemm panel: not for a TP rank or the compiled step; oneDNN's")
    if mc.cpu_onednn and onednn_available(device, dtype) and not panels:
        logger.info("oneDNN: %d projection weights prepacked", model.prepack())
    if device.type == "cpu" and single_device:
        # the batched forward's packed weights only where a step can have > 8 rows, and
        # for bf16 on AMX (`onednn_amx`) only where its GEMMs run on AMX tiles too
        # (faster than oneDNN's there at decode row counts, kernels/csrc/gemm_packed.cpp)
        batch = mc.batched_decode and config.scheduler.max_num_seqs > GEMV_MAX_ROWS
        ks = (arch.hidden_size, arch.num_attention_heads * arch.head_dim)
        on_amx = all(packed_bf16_amx(k) for k in (*ks, arch.intermediate_size))
        if batch and mc.cpu_onednn and onednn_amx(dtype) and not on_amx:
            logger.info("batched decode: off (bf16 on AMX: oneDNN's GEMMs are faster)")
            batch = False
        model.fused_decode = fused = FusedDecode.build(model, batch=batch)
        if panels and (fused.serve_prompt_steps() if fused is not None else 0):
            logger.info("prompt steps on the batched forward's panel copies: no oneDNN copy")
        elif panels and mc.cpu_onednn and onednn_available(device, dtype):
            logger.info(
                "prompt steps: no batched forward, so no panel copies: oneDNN's (%d "
                "projection weights prepacked)",
                model.prepack(),
            )
            model.fused_decode = fused = FusedDecode.build(model, batch=batch)
        freed = 0 if fused is None or mc.keep_plain_weights else fused.release_plain()
        if freed:
            logger.info(
                "plain projection weights freed (%.0f MiB): decode steps on the batched "
                "forward's copy from 1 row, the rest on %s",
                freed / 2**20,
                "the same copy" if panels and fused.batched else "oneDNN's",
            )
        else:
            how = "one native call" if fused is not None else "op by op"
            logger.info("decode steps of <= %d rows: %s", GEMV_MAX_ROWS, how)
