"""The engine's settings: the model, the KV cache, the scheduler, the compute device."""

from __future__ import annotations

from typing import Literal

from pydantic import ByteSize, field_validator

from pdserve.config.fields import Settings, setting

DEFAULT_MODEL = "smollm2-135m-instruct"


class ModelSettings(Settings):
    """What every node serves; the settings prefill and decode nodes must agree on."""

    name: str = setting(
        DEFAULT_MODEL, "built-in name, HF directory or .gguf file", flag="--model", min_length=1
    )
    served_name: str | None = setting(
        None, "model name in the API (default: `name`)", flag="--served-model-name"
    )
    dtype: Literal["float32", "bfloat16", "float16"] | None = setting(
        None,
        "weights and KV cache dtype (default: bfloat16 on CUDA, float32 on CPU); float32 is "
        "token-exact vs HF",
    )
    enforce_eager: bool | None = setting(
        None,
        "true: run the model step as plain torch (the reference); false: decode steps "
        "compiled whole with torch.compile, one graph per batch bucket up to "
        "`scheduler.max_num_seqs` (CPU; compiled code cached on disk under the pdserve "
        "cache dir); null: eager (measured as fast or faster, docs/benchmarks.md)",
    )
    batched_decode: bool = setting(
        True,
        "CPU fp32/bf16: decode steps of 9-256 rows as one native call on a copy of the "
        "projection and lm_head weights packed for it (~2x the weights' memory; false: "
        "oneDNN's GEMMs, op by op)",
    )
    keep_plain_weights: bool = setting(
        False,
        "CPU: keep the plain projection weights beside their packed copies; false: where "
        "`batched_decode` and oneDNN both pack them, the plain copy is freed and every "
        "decode step of up to 256 rows runs on the batched forward",
    )
    prompt_gemm: Literal["auto", "onednn", "panel"] = setting(
        "auto",
        "CPU fp32/bf16: what the GEMMs of steps with prompt tokens run on. onednn: a copy of "
        "every projection prepacked for oneDNN; panel: the batched decode forward's panel "
        "copy (with `batched_decode`), so no oneDNN copy is made and, the plain weights "
        "freed, each projection is held once; auto: panel on an AVX2 or AVX-512 CPU without "
        "AMX (fp32; bf16 on AVX2, or with avx512_bf16), else onednn (docs/benchmarks.md, "
        '"One form")',
    )
    max_model_len: int | None = setting(
        None, "longest sequence, prompt + output (default: the model's)", ge=2
    )


class KVFormatSettings(Settings):
    """The KV cache's shape in memory: prefill and decode nodes must agree on it.

    `kv_layout` (kv_transfer/kv_layout.py): layer_major stores [L, 2, N, bs, Hkv, D];
    block_major [N, L, 2, bs, Hkv, D], a block's every layer one contiguous range (one NIXL
    descriptor per run of blocks)."""

    block_size: int = setting(16, "tokens per KV block (a power of two)", ge=1)
    kv_layout: Literal["layer_major", "block_major"] = setting(
        "layer_major",
        "storage order of the paged KV cache: `layer_major` ([L, 2, N, ...]) or "
        "`block_major` ([N, L, 2, ...]: a block's every layer in one range, one NIXL "
        "descriptor per block run)",
    )

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"must be a power of two, got {v}")
        return v


class ComputeSettings(Settings):
    """Where a node's engine runs."""

    device: str = setting("cpu", "`cpu` or `cuda:N`")
    num_threads: int | None = setting(None, "engine torch threads per node", ge=1)
    tensor_parallel_size: int = setting(
        1,
        "ranks that run each step of a node together (tensor parallelism: one process per "
        "rank; CPU: the node's threads split over them, gloo; CUDA: one GPU each from "
        "`device` on, NCCL); must divide the attention heads; PD nodes: CPU and NIXL only, "
        "any TP on either side",
        ge=1,
    )


class CacheSettings(Settings):
    """A node's paged KV cache."""

    kv_cache_bytes: ByteSize = setting(
        ByteSize(1 << 30), "paged KV cache size per node, e.g. `256MiB`", gt=0
    )
    num_blocks: int | None = setting(None, "KV blocks (overrides the bytes)", ge=1)
    enable_prefix_caching: bool = setting(
        True, "reuse identical prompt prefixes", aliases=("--no-prefix-caching",)
    )
    kv_populate: bool = setting(
        True,
        "CPU: fault the KV cache in from a thread (seconds per GiB in some VMs), lowest "
        "blocks first, while the model loads and on after the node is ready, so the first "
        "requests do not pay page faults; false: each page faults in at its first write",
    )


class SchedulerSettings(Settings):
    """What a node's scheduler puts into each step."""

    max_num_seqs: int = setting(64, "requests in the running batch", ge=1)
    max_num_batched_tokens: int = setting(2048, "token budget of one step", ge=1)
    local_prefill_max_tokens: int = setting(
        16, "decode: prefill an uncached suffix this short locally", ge=0
    )
    on_prefill_failure: Literal["local", "error"] = setting(
        "local", "decode: when KV does not arrive, prefill locally or fail"
    )
