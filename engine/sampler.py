"""Turn logits into tokens: logits processing, greedy, temperature, top-k, top-p, min-p,
per-request seeds, and the logprobs (with top alternatives) each request asks for.

Fault isolation: a row whose distribution cannot be sampled (non-finite logits) fails
alone; the other rows of the batch are unaffected. A row whose own constraints leave no
token at all (every logit -inf after processing) is `Unsatisfiable`: its request ends
with finish_reason "stop" (it cannot go on), never as an engine error. The filters
(top-k, top-p, min-p) always keep the most likely token.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from pdserve.engine.logits_processors import process_logits
from pdserve.engine.outputs import TokenLogprobs
from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kernels.ops import argmax_rows

logger = logging.getLogger(__name__)


class Unsatisfiable(str):
    """Why a row has no token left: its request ends "stop", not as an error."""


class Sampled(NamedTuple):
    """One row's pick: the token, and its logprob / alternatives if the request asked."""

    token: int
    logprob: float | None = None
    top: TokenLogprobs | None = None


def sample(
    logits: torch.Tensor,  # [S, V] fp32, one row per sampling sequence
    reqs: list[Request],
) -> tuple[dict[int, Sampled], dict[int, str]]:
    """({row: sampled} for rows sampled, {row: error} for rows that failed).

    Logprobs are the log-softmax of the raw logits (before penalties, bias, grammar and
    temperature), as vLLM reports them by default."""
    processed = process_logits(logits, reqs)
    tokens = argmax_rows(processed).tolist()  # greedy picks (a native call on CPU)
    errors: dict[int, str] = {}
    if processed is not logits:  # only processing bars tokens (sets -inf)
        none_left = torch.isneginf(processed).all(dim=-1).nonzero().flatten().tolist()
        for i in none_left:
            errors[i] = Unsatisfiable("no token satisfies the request's constraints")
    for i, r in enumerate(reqs):
        if not r.sampling_params.greedy and i not in errors:
            try:
                tokens[i] = _sample_row(
                    processed[i], r.sampling_params, r.generator(processed.device)
                )
            except (RuntimeError, ValueError) as e:
                errors[i] = f"sampling failed: {e}"
    for i, r in enumerate(reqs):
        if r.grammar is not None and i not in errors:
            r.grammar.accept(tokens[i])
    out = {i: Sampled(t) for i, t in enumerate(tokens) if i not in errors}
    want = [i for i in out if reqs[i].sampling_params.logprobs]
    if not want:
        return out, errors
    idx = torch.tensor(want, device=logits.device)
    lp = torch.log_softmax(logits.index_select(0, idx), dim=-1)  # [w, V]
    chosen = torch.tensor([tokens[i] for i in want], device=logits.device)
    chosen_lp = lp.gather(1, chosen[:, None]).squeeze(1).tolist()
    k = max(reqs[i].sampling_params.top_logprobs for i in want)
    top_lp = top_ids = None
    if k:
        vals, ids = lp.topk(k, dim=-1)
        top_lp, top_ids = vals.tolist(), ids.tolist()
    for j, i in enumerate(want):
        top = None
        kr = reqs[i].sampling_params.top_logprobs
        if kr:
            top = TokenLogprobs([tokens[i], *top_ids[j][:kr]], [chosen_lp[j], *top_lp[j][:kr]])  # type: ignore[index]
        out[i] = Sampled(tokens[i], chosen_lp[j], top)
    return out, errors


def prompt_logprobs(
    logits: torch.Tensor,  # [P, V]: logits at P consecutive prompt positions
    next_ids: list[int],  # the P prompt tokens those positions predict
    k: int,
) -> list[TokenLogprobs]:
    """Each next prompt token's logprob and the top k at its position."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(next_ids, device=logits.device)
    chosen = lp.gather(1, ids[:, None]).squeeze(1).tolist()
    if k:
        vals, top = lp.topk(k, dim=-1)
        tv, ti = vals.tolist(), top.tolist()
        return [
            TokenLogprobs([t, *ti[j]], [c, *tv[j]])
            for j, (t, c) in enumerate(zip(next_ids, chosen))
        ]
    return [TokenLogprobs([t], [c]) for t, c in zip(next_ids, chosen)]


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
