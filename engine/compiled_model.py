"""The model step compiled piecewise with torch.compile (inductor, CPU C++/OpenMP).

What is compiled: the pieces of a decoder layer between two attentions (input norm +
residual add + qkv projection + RoPE; o_proj + residual add + norm + MLP) and the final
norm. What stays eager between them: paged attention and its in-place KV store, which
take the step's metadata (block tables, a Python count of decode rows) and write into
the one KV cache tensor. Compiling the whole forward instead would make that cache a
mutated graph input (functionalization copies or guards on it) and specialise the graph
on the metadata; piecewise, the graphs see only per-token tensors and weights.

One graph per piece serves all layers: a piece takes its layer as an argument, and
dynamo lifts the layer's parameters to graph inputs (no freezing, which would bake each
layer's weights into its own graph: 30x the compile time). The GEMMs inside are the
prepacked-oneDNN custom op (engine/models/cpu_linear.py); inductor fuses the rest
(norms, RoPE, SiLU*mul, residual adds) into C++ loops.

Shapes: the token count is a dynamic dimension (`dynamic=True`), so one graph serves
every batch size: 3 graphs to compile, where fixed shapes would need 3 per bucket.
Dynamo specialises a size of 1, so a one-token step is padded to 2 rows around the
pieces. `warm_up_compiled` compiles the 3 graphs at start and serving never compiles
again (tests check the dynamo counters). Compiled code is cached on disk by inductor's
FX graph and AOT caches under `cache_dir`, so a restarted node loads, not compiles.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from engine.models.llama import LlamaDecoderLayer, final_norm

logger = logging.getLogger(__name__)

MIN_TOKENS = 2  # pieces see at least this many rows (a size of 1 would be its own graph)


def set_compile_cache_dir(path: str) -> None:
    """Inductor's on-disk caches (FX graphs, AOT autograd, C++ builds) live under `path`.

    Inductor reads TORCHINDUCTOR_CACHE_DIR whenever it looks a cache up (and sets it
    itself to /tmp/torchinductor_$USER when unset), so the configured directory is
    written there before the first compile, replacing any earlier value.
    """
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    torch._inductor.config.fx_graph_cache = True
    torch._functorch.config.enable_autograd_cache = True


class CompiledPieces:
    """The same pieces as `EagerPieces`, compiled lazily on first call.

    Each piece has exactly one graph: a step of one token is padded to `MIN_TOKENS` rows
    around the piece (dynamo would specialise a size of 1 into a second graph), and the
    first layer gets a zero residual instead of None (x + 0 is exact).
    """

    def __init__(self) -> None:
        opts = dict(dynamic=True, fullgraph=True)
        self._before = torch.compile(LlamaDecoderLayer.before_attention, **opts)
        self._after = torch.compile(LlamaDecoderLayer.after_attention, **opts)
        self._final = torch.compile(final_norm, **opts)

    def before_attention(self, layer, positions, x, residual, cos_sin):
        n = x.shape[0]
        if residual is None:
            residual = torch.zeros_like(x)
        if n < MIN_TOKENS:
            positions, x, residual = (_pad(t) for t in (positions, x, residual))
        q, k, v, residual = self._before(layer, positions, x, residual, cos_sin)
        return q[:n], k[:n], v[:n], residual[:n]

    def after_attention(self, layer, o, residual):
        n = o.shape[0]
        if n < MIN_TOKENS:
            o, residual = _pad(o), _pad(residual)
        x, residual = self._after(layer, o, residual)
        return x[:n], residual[:n]

    def final_norm(self, norm, x, residual):
        n = x.shape[0]
        if n < MIN_TOKENS:
            x, residual = _pad(x), _pad(residual)
        return self._final(norm, x, residual)[:n]


def _pad(t: torch.Tensor) -> torch.Tensor:
    """`t` with zero rows appended up to MIN_TOKENS rows."""
    return torch.cat([t, t.new_zeros((MIN_TOKENS - t.shape[0], *t.shape[1:]))])


def compiled_graph_count() -> int:
    """Graphs dynamo has compiled in this process (grows on any recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def warm_up_compiled(model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int) -> None:
    """Compile (or load from the disk cache) the three graphs serving will use: one
    dummy step of two decode rows whose KV slots are -1 (the cache is untouched)."""
    from engine.warmup import dummy_batch

    t0 = time.perf_counter()
    logger.info("compiling the model step (3 graphs; cached on disk for the next start)")
    with torch.inference_mode():
        model(*dummy_batch([1] * MIN_TOKENS, 1, kv_cache, block_size))
    logger.info("compile warm-up done in %.1f s", time.perf_counter() - t0)
