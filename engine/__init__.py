"""The model-execution core every pdserve node runs.

A request enters as token ids plus `SamplingParams`; the `Scheduler` decides each step which
requests run and how many of their tokens (one token budget, chunked prefill, preemption by
recompute); the `KVCacheManager` hands out paged KV blocks from a `BlockPool` that keeps a
chained-hash prefix cache; the `ModelRunner` executes one flattened variable-length batch;
`EngineCore.step()` ties these together. `LLM` is the offline API on top.
"""

from pdserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it lazily so light users stay light.
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
