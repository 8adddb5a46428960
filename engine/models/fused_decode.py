"""A Llama model's decode steps in few native calls (kernels/decode_forward.py).

`FusedDecode.build(model)` describes the model to the native chain once, at load: every
layer's weight and norm pointers, the RoPE table, the embedding. The KV cache's per-layer
planes are added the first time a cache is seen (a runner has one; tests bring their
own). `__call__(input_ids, positions, kv_cache, meta)` returns a decode-only step's hidden
states:

- up to `ops.GEMV_MAX_ROWS` rows: the whole forward as one native call on the plain
  weights (`steps` counts them);
- more rows, up to `BATCH_MAX_ROWS`, fp32 or bf16 (every row count from 1 once
  `release_plain` has freed the plain projection weights, the node's default where oneDNN
  packs them too): the whole forward as one native call and
  one OpenMP parallel region on weights packed at build for kernels/csrc/gemm_packed.cpp
  (`batch_steps`; `logits` runs the lm_head of such a step the same way). Not bit-equal
  to the per-op path (other GEMMs: each output one fp32 chain over k, the residual add in
  the GEMM's store; bf16 rounded where the per-op path's bf16 tensors round, which
  depends on whether oneDNN fuses SiLU * up into its gate_up GEMM: `silu_fused`); the norms,
  RoPE, K/V store and attention are the same kernels;
- otherwise (more rows, no packed weights): a plain loop over
  the layers calling the per-op path's own functions without its module calls and views,
  with each layer's RoPE + KV store + attention as one native call (`layer_steps`);

or None for a step it does not take, which the model then runs op by op: prompt tokens in
the step, an empty step, more rows than an MLP row tile; inputs of another dtype or not
contiguous, a cache of another dtype or whose blocks are not each contiguous; positions,
slots or context lengths out of range, token ids too for the one-call path (the per-op
path then raises or handles them as it always has; nothing was written).

`build` returns None (per-op path always) off CPU, outside the native op set
(pdserve.kernels.cpu_ops), for dtypes other than fp32/bf16, head dims the attention kernel lacks,
norms with different eps, a RoPE table that is not [max_pos, head_dim] fp32, or where a
native library cannot be built. The plan keeps every tensor it points into alive. Results
equal the per-op path's bit for bit: the same kernels run with the same arguments
(tests/test_fused_decode.py).
"""

from __future__ import annotations

import ctypes
import logging

import torch

from pdserve.engine.models.cpu_linear import linear, silu_fused
from pdserve.engine.models.llama import mlp_tile_rows
from pdserve.kernels import ops

logger = logging.getLogger(__name__)

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# decode steps of MAX_ROWS < m <= this many rows take the batched forward
BATCH_MAX_ROWS = 256


def _row_stride(w: torch.Tensor) -> int:
    if w.dim() != 2 or w.stride(1) != 1:
        raise ValueError("weight rows not contiguous")
    return w.stride(0)


class FusedDecode:
    def __init__(
        self, model: torch.nn.Module, lib, kernels: dict[str, int], batch: bool = True
    ) -> None:
        cfg = model.config
        layers = model.model.layers
        attn = layers[0].self_attn
        self.model = model
        self.dtype = model.model.embed_tokens.weight.dtype
        self._ops = attn.ops  # the native CPU op set (checked by `build`)
        self._fn = lib.pdserve_decode_forward
        self._attend = lib.pdserve_decode_attention
        # larger steps: (input norm, qkv, qkv bias, o, post norm, gate_up module, down) a layer
        self._weights = [
            (
                layer.input_layernorm.weight, layer.self_attn.qkv_proj.weight,
                layer.self_attn.qkv_proj.bias, layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight, layer.mlp.gate_up_proj,
                layer.mlp.down_proj.weight,
            )
            for layer in layers
        ]  # fmt: skip
        self._eps = model.model.norm.eps
        self._q_size = attn.q_size
        # every tensor the plan points into, kept alive here: a weight, norm or RoPE table
        # replaced on the model after the build (a Parameter swapped, `init_rope` again)
        # must not leave the native chain reading freed memory
        self._bound: list[torch.Tensor] = []
        self._plain: list[torch.Tensor] = []  # the projections' plain weights (one-call path)

        def _ptr(t: torch.Tensor | None, into: list[torch.Tensor] = self._bound) -> int | None:
            if t is None:
                return None
            into.append(t.detach())  # shares the storage, whatever the module does
            return t.data_ptr()

        def _plain(t: torch.Tensor | None) -> int | None:
            return _ptr(t, self._plain)

        self._layers = (ops.DecodeLayer * len(layers))()
        for i, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp
            self._layers[i] = ops.DecodeLayer(
                input_norm=_ptr(layer.input_layernorm.weight),
                qkv=_plain(a.qkv_proj.weight), qkv_ws=_row_stride(a.qkv_proj.weight),
                qkv_bias=_ptr(a.qkv_proj.bias),
                o=_plain(a.o_proj.weight), o_ws=_row_stride(a.o_proj.weight),
                post_norm=_ptr(layer.post_attention_layernorm.weight),
                gate_up=_plain(mlp.gate_up_proj.weight),
                gate_up_ws=_row_stride(mlp.gate_up_proj.weight),
                down=_plain(mlp.down_proj.weight), down_ws=_row_stride(mlp.down_proj.weight),
            )  # fmt: skip
        # steps of more than MAX_ROWS rows: the batched forward on packed weights
        self._batch_fn = lib.pdserve_decode_forward_batch if batch else None
        team = ops.packed_team_address(self.dtype) if self._batch_fn is not None else None
        self._packed: list[ops.PackedWeight] = []  # kept alive: the layers point into them
        self.lm_head: ops.PackedWeight | None = None
        if team is not None:
            try:
                for i, layer in enumerate(layers):
                    a, mlp = layer.self_attn, layer.mlp
                    ps = [ops.PackedWeight(a.qkv_proj.weight),
                          ops.PackedWeight(a.o_proj.weight),
                          ops.PackedWeight(mlp.gate_up_proj.weight, silu=True),
                          ops.PackedWeight(mlp.down_proj.weight)]  # fmt: skip
                    self._packed += ps
                    lay = self._layers[i]
                    lay.qkv_p, lay.o_p, lay.gate_up_p, lay.down_p = (q.ptr() for q in ps)
                self.lm_head = ops.PackedWeight(model.lm_head_weight)
            except ValueError as e:  # a weight the packing does not take: by layer
                logger.info("batched decode off: %s", e)
                for i in range(len(layers)):
                    lay = self._layers[i]
                    lay.qkv_p = lay.o_p = lay.gate_up_p = lay.down_p = None
                self._packed, self.lm_head, team = [], None, None
        if team is None or self.lm_head is None:
            self._batch_fn = None
            team = None
        else:
            packed = sum(p.data.nbytes for p in [*self._packed, self.lm_head])
            logger.info("batched decode: %.0f MiB of packed weights", packed / 2**20)
        embed = model.model.embed_tokens.weight
        self._model = ops.DecodeModel(
            **kernels,
            num_layers=len(layers), hidden=cfg.hidden_size, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            intermediate=layers[0].mlp.down_proj.in_features, vocab=embed.shape[0],
            eps=model.model.norm.eps, scale=attn.attn.scale, dtype=_DTYPES[self.dtype],
            embed=_ptr(embed), embed_stride=_row_stride(embed),
            final_norm=_ptr(model.model.norm.weight),
            cos_sin=_ptr(model.cos_sin), max_pos=model.cos_sin.shape[0],
            layers=self._layers, gemm_packed_team=team, **ops.decode_forward_constants(),
            # gate_up + SiLU * up rounded as the per-op MLP rounds (oneDNN post-ops on fp32
            # accumulators, or the unfused GEMM's bf16 output where oneDNN cannot pack bf16)
            silu_mode=1 if silu_fused(layers[0].mlp.gate_up_proj.weight) else 2,
        )  # fmt: skip
        self._model_ref = ctypes.addressof(self._model)
        self._cache_key: tuple | None = None
        self._cache: torch.Tensor | None = None  # kept alive: the plan points into it
        self.steps = 0  # steps run as one call
        self.layer_steps = 0  # larger steps run with one attention call a layer
        self.batch_steps = 0  # larger steps run as one call on packed weights
        self._batched_rows = 0  # rows of the last call if it was a batched step (logits)
        # decode steps of more rows than this (up to BATCH_MAX_ROWS) take the batched forward;
        # 0 once the plain weights are released (`release_plain`)
        self.batch_from = ops.GEMV_MAX_ROWS

    @classmethod
    def build(cls, model: torch.nn.Module, batch: bool = True) -> FusedDecode | None:
        """The fused decode for `model`, or None where it cannot run (see the module doc).
        batch=False: no packed weights, larger steps always by layer."""
        layers = model.model.layers
        embed = model.model.embed_tokens.weight
        if not embed.is_cpu or embed.dtype not in _DTYPES or not len(layers):
            return None
        attn = layers[0].self_attn
        if not ops.is_native_cpu_ops(attn.ops) or not ops.paged_decode_head_dim_supported(
            attn.head_dim
        ):
            return None
        norms = [model.model.norm]
        for layer in layers:
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        if any(n.eps != norms[0].eps for n in norms):
            return None
        cos_sin = model.cos_sin  # the native RoPE reads rows of head_dim floats
        if cos_sin.dtype != torch.float32 or not cos_sin.is_contiguous():
            return None
        if cos_sin.dim() != 2 or cos_sin.shape[1] != attn.head_dim:
            return None
        if any(p.dtype != embed.dtype or not p.is_cpu for p in model.parameters()):
            return None
        found = ops.decode_forward_libraries()
        if found is None:
            return None
        try:
            return cls(model, *found, batch=batch)
        except ValueError:  # a weight whose rows are not contiguous
            return None

    def _bind_cache(self, kv_cache: torch.Tensor) -> bool:
        """Point every layer at its planes of `kv_cache` ([L, 2, N, bs, Hkv, D])."""
        if kv_cache.dtype != self.dtype or not kv_cache.is_cpu or kv_cache.dim() != 6:
            return False
        planes = kv_cache[0, 0]
        if not ops.blocks_contiguous(planes) or kv_cache.shape[0] != len(self._layers):
            return False
        attn = self.model.model.layers[0].self_attn
        if kv_cache.shape[4:] != (attn.num_kv_heads, attn.head_dim):
            return False
        for i in range(len(self._layers)):
            self._layers[i].k_cache = kv_cache[i, 0].data_ptr()
            self._layers[i].v_cache = kv_cache[i, 1].data_ptr()
        m = self._model
        m.block_size, m.block_stride, m.num_blocks = (
            planes.shape[1],
            planes.stride(0),
            planes.shape[0],
        )
        self._cache = kv_cache
        return True

    def __call__(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_cache: torch.Tensor,  # [L, 2, N, bs, Hkv, D]
        meta,  # engine.attention.AttentionMetadata
    ) -> torch.Tensor | None:  # [T, hidden]
        m = input_ids.shape[0]
        self._batched_rows = 0
        if m == 0 or meta.num_decode_tokens != m or torch.compiler.is_compiling():
            return None
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
        if key != self._cache_key:
            if not self._bind_cache(kv_cache):
                return None
            self._cache_key = key
        slots, tables, lens = meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens
        if (
            input_ids.dtype != torch.int64
            or positions.dtype != torch.int64
            or slots.dtype != torch.int64
            or tables.dtype != torch.int32
            or lens.dtype != torch.int32
            or not (input_ids.is_contiguous() and positions.is_contiguous())
            or not (slots.is_contiguous() and tables.is_contiguous() and lens.is_contiguous())
            or not input_ids.is_cpu
        ):
            return None
        # the native chain reads m of each: fewer (an inconsistent step) is not taken
        if positions.shape != (m,) or slots.shape != (m,) or lens.shape != (m,):
            return None
        if tables.dim() != 2 or tables.shape[0] != m:
            return None
        fn = self._fn
        if m > self.batch_from:
            if self._batch_fn is None or m > BATCH_MAX_ROWS:
                return self._by_layer(input_ids, positions, slots, tables, lens, m)
            fn = self._batch_fn
        out = torch.empty((m, self._model.hidden), dtype=self.dtype)
        rc = fn(
            self._model_ref, input_ids.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            tables.data_ptr(), tables.shape[1], lens.data_ptr(), m, out.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        if rc == 5:
            raise RuntimeError(f"fused decode forward: {ops.DECODE_FORWARD_ERRORS[rc]}")
        if rc != 0:  # bad inputs, nothing written: the per-op path handles them as it does
            return None
        if fn is self._fn:
            self.steps += 1
        else:
            self.batch_steps += 1
            self._batched_rows = m
        return out

    @property
    def batched(self) -> bool:
        """Whether the batched forward on packed weights was built."""
        return self._batch_fn is not None

    def release_plain(self) -> int:
        """Free the plain projection weights where both packed copies hold them: the panel
        copy here (every decode step of up to BATCH_MAX_ROWS rows, 1 row on, then runs the
        batched forward) and oneDNN's (steps with prompt tokens, larger decode steps, the
        per-op path; engine/models/cpu_linear.py). The one-call path, which streams the
        plain rows, never runs again. Every lm_head call then takes the panel copy (`logits`),
        and a tied lm_head's oneDNN copy is dropped (its plain weight stays: it is the
        embedding's table). Returns the bytes freed (0: not both packed, nothing done)."""
        from pdserve.engine.models.cpu_linear import (
            PackedLinear,
            drop_packed,
            is_packed,
            release_plain,
        )

        linears = [m for m in self.model.modules() if isinstance(m, PackedLinear)]
        if not self.batched or not all(is_packed(m.weight) for m in linears):
            return 0
        for i in range(len(self._layers)):
            lay = self._layers[i]
            lay.qkv = lay.o = lay.gate_up = lay.down = None
        self._plain.clear()
        self.batch_from = 0
        freed = sum(release_plain(m.weight) for m in linears)
        if self.model.tie_word_embeddings:
            freed += drop_packed(self.model.lm_head_weight)
        return freed

    def serve_prompt_steps(self) -> int:
        """Run steps with prompt tokens, and any step the batched forward declines, on the
        panel copies too (`model.prompt_gemm: panel`, where the runner made no oneDNN copy):
        every projection's `linear` goes to its panel copy (cpu_linear.PanelForm), gate_up
        with SiLU * up of the fp32 accumulators (silu mode 1, as the decode forward is set
        to here). `release_plain` then leaves one form of each projection. Returns how many
        weights were given their panel copy (0: no batched forward, nothing done)."""
        from pdserve.engine.models.cpu_linear import serve_with_panel

        if not self.batched:
            return 0
        weights = []
        for layer in self.model.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            weights += [a.qkv_proj.weight, a.o_proj.weight, mlp.gate_up_proj.weight,
                        mlp.down_proj.weight]  # fmt: skip
        for w, p in zip(weights, self._packed, strict=True):
            serve_with_panel(w, p)
        self._model.silu_mode = 1
        return len(weights)

    def clear_step(self) -> None:
        """A step ran another path: `logits` has no batched step to follow."""
        self._batched_rows = 0

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The lm_head of the batched decode step just run (its rows, fp32 [m, vocab]; bf16:
        the bf16 logits' values, as the model's own bf16 GEMM then .float()) on the packed
        weight, or None (another step, or called twice: the model's own lm_head GEMM then).
        Once the plain weights are released (`release_plain`), every call's: any step's
        rows, as many as there are."""
        m = hidden.shape[0] if hidden.dim() == 2 else 0
        rows, self._batched_rows = self._batched_rows, 0
        if self.lm_head is None or not m or hidden.dtype != self.dtype or not hidden.is_cpu:
            return None
        if self.batch_from and not (m == rows and self.batch_from < m <= BATCH_MAX_ROWS):
            return None
        return self.lm_head.linear(hidden.contiguous())

    def _by_layer(self, input_ids, positions, slots, tables, lens, m) -> torch.Tensor | None:
        """A decode step of more than MAX_ROWS rows: the per-op path's own calls (the
        prepacked oneDNN GEMMs, SiLU * up fused into gate_up, cpu_ops' native norms)
        without its module calls and views, and each layer's RoPE + KV store + attention
        as one native call. Mirrors LlamaDecoderLayer: a change there is a change here
        (tests/test_fused_decode.py compares the two bit for bit)."""
        mlp = self.model.model.layers[0].mlp
        tile = mlp.tile_rows
        if tile is None:
            tile = mlp_tile_rows(mlp.down_proj.in_features, self.dtype)
        if tile and m > tile:  # the per-op MLP would run in row tiles
            return None
        eps, ref, attend = self._eps, self._model_ref, self._attend
        rows = (positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), tables.shape[1])
        rows = (*rows, lens.data_ptr(), m)
        threads = torch.get_num_threads()
        x = self.model.model.embed_tokens(input_ids)
        residual = None
        for i, (in_w, qkv_w, qkv_b, o_w, post_w, gate_up, down_w) in enumerate(self._weights):
            if residual is None:
                h, residual = self._ops.rms_norm(x, in_w, eps), x
            else:
                h, residual = self._ops.fused_add_rms_norm(x, residual, in_w, eps)
            qkv = linear(h, qkv_w, qkv_b)
            if not qkv.is_contiguous():
                return None
            o = torch.empty((m, self._q_size), dtype=self.dtype)
            rc = attend(ref, i, qkv.data_ptr(), *rows, o.data_ptr(), threads)
            if rc:  # checked before the first store: the per-op path takes the step
                if i == 0 and rc != 5:
                    return None
                raise RuntimeError(f"fused decode attention: {ops.DECODE_FORWARD_ERRORS[rc]}")
            h, residual = self._ops.fused_add_rms_norm(linear(o, o_w, None), residual, post_w, eps)
            # LlamaMLP._mlp above MAX_ROWS: SiLU * up as oneDNN post-ops of the packed halves
            act = gate_up.silu_mul(h)
            if act is None:
                act = self._ops.silu_and_mul(linear(h, gate_up.weight, None))
            x = linear(act, down_w, None)
        self.layer_steps += 1
        return self._ops.fused_add_rms_norm(x, residual, self.model.model.norm.weight, eps)[0]
