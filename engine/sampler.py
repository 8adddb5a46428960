"""Turn logits into tokens: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Fault isolation: a row whose distribution cannot be sampled (non-finite logits, a filter
that leaves nothing) fails alone; the other rows of the batch are unaffected.
"""

from __future__ import annotations

import logging

import torch

from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class SampleResult:
    """Per row: the token (None where that row failed), its logprob, the failure."""

    __slots__ = ("tokens", "logprobs", "errors")

    def __init__(self, tokens: list[int], logprobs: list[float] | None, errors: dict[int, str]):
        self.tokens = tokens
        self.logprobs = logprobs
        self.errors = errors


def sample(
    logits: torch.Tensor,  # [S, V] fp32, one row per sampling sequence
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> SampleResult:
    """Sampled token per row, and the sampled tokens' logprobs (raw logits) if any row asks."""
    greedy = logits.argmax(dim=-1)
    tokens = greedy.tolist()
    errors: dict[int, str] = {}
    for i, p in enumerate(params):
        if not p.greedy:
            try:
                tokens[i] = _sample_row(logits[i], p, generators[i])
            except (RuntimeError, ValueError) as e:
                errors[i] = f"sampling failed: {e}"
    logprobs = None
    if any(p.logprobs for p in params):
        lp = torch.log_softmax(logits, dim=-1)
        idx = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        logprobs = lp.gather(1, idx[:, None]).squeeze(1).tolist()
    return SampleResult(tokens, logprobs, errors)


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    # Shift by the max first: the top logit becomes 0, so even a tiny temperature yields
    # finite values (-inf at worst) and softmax stays defined.
    logits = (logits - logits.max()) / p.temperature
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
    total = float(probs.sum())
    if not (total > 0.0 and torch.isfinite(probs).all()):
        raise ValueError("the token distribution is not finite (non-finite logits)")
    return int(torch.multinomial(probs, 1, generator=gen).item())
