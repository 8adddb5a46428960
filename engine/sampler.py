"""Turn logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor,  # [S, V] fp32, one row per sampling sequence
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> tuple[list[int], list[float] | None]:
    """Sampled token per row, and the sampled tokens' logprobs (raw logits) if any row asks."""
    greedy = logits.argmax(dim=-1)
    tokens = greedy.tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            tokens[i] = _sample_row(logits[i], p, generators[i])
    logprobs = None
    if any(p.logprobs for p in params):
        lp = torch.log_softmax(logits, dim=-1)
        idx = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        logprobs = lp.gather(1, idx[:, None]).squeeze(1).tolist()
    return tokens, logprobs


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if p.top_k is not None and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(-1)
        # keep the smallest prefix whose mass reaches top_p (always the top token)
        drop = (cum - sorted_probs) >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen).item())
