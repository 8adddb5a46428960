"""The Llama family (Llama, Mistral, Qwen2, SmolLM2) over a paged KV cache.

Merged projections: q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`. Qwen2 adds a bias
to qkv. Every op goes through the kernel backend (`pdserve.kernels.reference` or Triton), so the
model code is the same on CPU and GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

import torch
from torch import nn

from pdserve.engine.attention import AttentionMetadata, PagedAttention
from pdserve.engine.model_arch import ModelArch
from pdserve.engine.models.cpu_linear import (
    PackedGateUp,
    PackedLinear,
    linear,
    pack_linears,
    pack_weight,
)
from pdserve.engine.models.rope import build_cos_sin_cache
from pdserve.engine.step_plan import ForwardPath, StepPlan, plan_step

_STACKED = {  # HF name fragment -> (merged name, shard index)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelArch, ops: ModuleType):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = PackedLinear(self.q_size, cfg.hidden_size, bias=False)
        self.attn = PagedAttention(ops, self.num_heads, self.num_kv_heads, self.head_dim)
        self.ops = ops

    def project_qkv(self, positions, x, cos_sin, gemv: bool = True):
        """[T, hidden] -> q [T, H, D], k and v [T, Hkv, D], RoPE applied."""
        return self.split_qkv(positions, self.qkv_proj(x, gemv), cos_sin)

    def split_qkv(self, positions, qkv, cos_sin):
        """qkv [T, (H + 2 Hkv) D] -> q [T, H, D], k and v [T, Hkv, D], RoPE applied."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = qkv.shape[0]
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        self.ops.rotary_embedding(positions, q, k, cos_sin)
        return q, k, v


# Bytes of gate_up output per MLP tile in a long (prefill) step on CPU: the [rows,
# 2 * intermediate] intermediate then stays in the last-level cache (32 MiB on the
# benchmark box) instead of going out to DRAM and back. SmolLM2 fp32: tiles of 2048 rows
# (untiled, a 4096-row step writes and rereads 50 MB per layer); bf16: 4096 rows, so
# workload C's step is not cut (tiles gained nothing there, and every tile is another
# fork/join of the GEMM threads). See docs/benchmarks-history.md, "Second round".
MLP_TILE_BYTES = 24 << 20


def mlp_tile_rows(intermediate: int, dtype: torch.dtype) -> int:
    """Rows per MLP tile: MLP_TILE_BYTES of gate_up output, at least 256 rows (smaller
    GEMMs lose efficiency)."""
    return max(256, MLP_TILE_BYTES // (2 * intermediate * dtype.itemsize))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelArch, ops: ModuleType):
        super().__init__()
        self.gate_up_proj = PackedGateUp(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = PackedLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops
        self.tile_rows: int | None = None  # rows per tile; None: mlp_tile_rows; 0: never tile

    def _mlp(self, x, gemv: bool):
        # An op set that fuses the activation (the CPU one) runs SiLU * up inside gate_up:
        # decode rows in one native call (`gate_up_silu`), more rows as oneDNN post-ops of
        # the packed halves (PackedGateUp.silu_mul); None where neither takes x.
        h = None
        if self.ops.FUSES_MLP_ACTIVATION:
            h = self.ops.gate_up_silu(x, self.gate_up_proj.weight) if gemv else None
            if h is None:
                h = self.gate_up_proj.silu_mul(x)
        if h is None:
            h = self.ops.silu_and_mul(self.gate_up_proj(x, gemv))
        return self.down_proj(h, gemv)

    def forward(self, x, gemv: bool = True):
        """[T, hidden] -> [T, hidden]; above the tile's rows, in equal row tiles (each
        row's result is the same either way: the MLP is row-wise)."""
        rows = x.shape[0]
        if torch.compiler.is_compiling() or not x.is_cpu:
            return self._mlp(x, gemv)
        tile = self.tile_rows
        if tile is None:
            tile = mlp_tile_rows(self.down_proj.in_features, x.dtype)
        if not tile or rows <= tile:
            return self._mlp(x, gemv)
        tiles = -(-rows // tile)
        step = -(-rows // tiles)  # equal tiles: 4096 rows at 2048 -> 2 x 2048, 2100 -> 2 x 1050
        out = x.new_empty(rows, self.down_proj.out_features)
        for s in range(0, rows, step):
            out[s : s + step] = self._mlp(x[s : s + step], gemv)
        return out


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, ops: ModuleType):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        self.ops = ops

    def forward(self, x, residual=None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArch, ops: ModuleType):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, ops)
        self.mlp = LlamaMLP(cfg, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    # The layer as two halves around attention, which reads and writes the paged KV cache.
    # CPU decode rows: the op set's `norm_linear` runs a norm and the projection after it
    # as one call; it returns None for what it does not take (every input, off the CPU).
    # gemv (the step's plan, engine/step_plan.py): False in a step with prompt tokens.
    def before_attention(self, positions, x, residual, cos_sin, gemv: bool = True):
        """Input norm (+ the residual add of the previous layer), qkv projection, RoPE."""
        attn, norm = self.self_attn, self.input_layernorm
        if gemv:
            w, b = attn.qkv_proj.weight, attn.qkv_proj.bias
            out = attn.ops.norm_linear(x, residual, norm.weight, norm.eps, w, b, False)
            if out is not None:
                return (*attn.split_qkv(positions, out[0], cos_sin), out[1])
        x, residual = norm(x, residual)
        q, k, v = attn.project_qkv(positions, x, cos_sin, gemv)
        return q, k, v, residual

    def after_attention(self, o, residual, gemv: bool = True):
        """o_proj, residual add + norm, MLP. o: [T, H, D]."""
        x = self.self_attn.o_proj(o.reshape(o.shape[0], -1), gemv)
        norm, mlp = self.post_attention_layernorm, self.mlp
        if gemv:
            w = mlp.gate_up_proj.weight
            out = mlp.ops.norm_linear(x, residual, norm.weight, norm.eps, w, None, True)
            if out is not None:
                return mlp.down_proj(out[0], gemv), out[1]
        x, residual = norm(x, residual)
        return mlp(x, gemv), residual


def final_norm(norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return norm(x, residual)[0]


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelArch, ops: ModuleType):
        super().__init__()
        # its weight given, not initialised: a random init of a meta tensor imports
        # torch._dynamo (~2.7 s of CPU at each engine start), for values loading replaces
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, ops) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelArch, ops: ModuleType):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, ops)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = PackedLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # [max_pos, head_dim] fp32, filled by `init_rope` once the model is on its device
        # (the model is built under the meta device, and `.to(bf16)` would round it).
        self.register_buffer("cos_sin", torch.empty(0, cfg.head_dim), persistent=False)
        # decode steps compiled per batch bucket (engine/compiled_model.py); None: eager
        self.compiled_decode: Callable[..., torch.Tensor | None] | None = None
        # CPU decode steps of a few rows as one native call (engine/models/fused_decode.py,
        # set at load by the runner); None: op by op
        self.fused_decode: Callable[..., torch.Tensor | None] | None = None

    def init_rope(self, device: torch.device) -> None:
        """Compute the RoPE table (fp32, whatever the model's dtype) on `device`."""
        self.cos_sin = build_cos_sin_cache(self.config).to(device)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,  # [L, 2, N, bs, Hkv, D]
        meta: AttentionMetadata,
        plan: StepPlan | None = None,  # the runner's choice; None: plan_step's default
        out_rows: torch.Tensor | None = None,  # [S] rows whose hidden state is returned
    ) -> torch.Tensor:  # [T, hidden], or [S, hidden] with out_rows
        """The final hidden states. `out_rows` (a step with prompt tokens: the rows that
        sample): the last layer computes its K/V and attention for every row (later steps
        read the K/V), then o_proj, the MLP and the final norm only for these rows: every
        other row's output is unused. A row's result is the one it would get unpruned."""
        if plan is None:
            plan = plan_step(self, meta)
        if plan.path is ForwardPath.COMPILED:
            hidden = self.compiled_decode(input_ids, positions, kv_cache, meta)
            return hidden if out_rows is None else hidden[out_rows]
        if plan.path is ForwardPath.FUSED:
            hidden = self.fused_decode(input_ids, positions, kv_cache, meta)
            if hidden is not None:  # None: inputs it declines (out of range), nothing written
                return hidden if out_rows is None else hidden[out_rows]
        elif self.fused_decode is not None:
            self.fused_decode.clear_step()
        gemv = plan.gemv
        x = self.model.embed_tokens(input_ids)
        residual = None
        last = len(self.model.layers) - 1
        for i, layer in enumerate(self.model.layers):
            q, k, v, residual = layer.before_attention(positions, x, residual, self.cos_sin, gemv)
            o = layer.self_attn.attn(q, k, v, kv_cache[i, 0], kv_cache[i, 1], meta)  # [T, H, D]
            if i == last and out_rows is not None:
                if out_rows.numel() == 0:  # no row samples (a prompt's earlier chunk)
                    return x.new_empty(0, x.shape[1])
                o, residual = o[out_rows], residual[out_rows]
            x, residual = layer.after_attention(o, residual, gemv)
        return final_norm(self.model.norm, x, residual)

    def compute_logits(self, hidden: torch.Tensor, plan: StepPlan | None = None) -> torch.Tensor:
        """[S, hidden] -> [S, vocab] fp32 logits, only for the rows that sample; `plan`:
        the step's (None: a decode step's)."""
        fused = self.fused_decode
        # a batched decode step's rows (any step's once the plain weights are released):
        # the packed lm_head
        if fused is not None and (
            fused.batch_from == 0 or plan is None or plan.path is ForwardPath.FUSED
        ):
            logits = fused.logits(hidden)
            if logits is not None:
                return logits
        return linear(hidden, self.lm_head_weight, None, gemv=plan is None or plan.gemv).float()

    def prepack(self) -> int:
        """CPU: reorder every projection's weight (lm_head too) for oneDNN once."""
        if self.tie_word_embeddings:
            pack_weight(self.lm_head_weight)
        return pack_linears(self)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, merging q/k/v and gate/up; raise on anything unknown."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            merged = next((frag for frag in _STACKED if f".{frag}." in name), None)
            if merged is None:
                if name not in params:
                    raise KeyError(f"unexpected weight {name!r} in checkpoint")
                params[name].copy_(tensor)
                loaded.add(name)
                continue
            target_name, shard = _STACKED[merged]
            pname = name.replace(merged, target_name)
            param = params[pname]
            sizes = _shard_sizes(self.model.layers[0], target_name, param.shape[0])
            offset = sum(sizes[:shard])
            param[offset : offset + sizes[shard]].copy_(tensor)
            loaded.add(f"{pname}#{shard}")
        expected = set()
        for pname in params:
            if "qkv_proj" in pname:
                expected |= {f"{pname}#{i}" for i in range(3)}
            elif "gate_up_proj" in pname:
                expected |= {f"{pname}#{i}" for i in range(2)}
            else:
                expected.add(pname)
        missing = expected - loaded
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")


def _shard_sizes(layer: LlamaDecoderLayer, target: str, total: int) -> list[int]:
    if target == "qkv_proj":
        a = layer.self_attn
        return [a.q_size, a.kv_size, a.kv_size]
    return [total // 2, total // 2]
