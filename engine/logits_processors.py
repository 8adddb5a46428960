"""Per-request logits processing, batched over the rows that need it.

`process_logits` returns the logits untouched (no copy, no Python work per row beyond one
flag check) when no row uses a penalty, a bias, `min_tokens` or a grammar. Otherwise it
gathers just those rows and applies, in order: the repetition penalty (transformers'
`RepetitionPenaltyLogitsProcessor`), frequency and presence penalties (OpenAI's formula),
`logit_bias`, the grammar mask, and `min_tokens` (transformers'
`MinNewTokensLengthLogitsProcessor`, also barring `stop_token_ids`). Each is one tensor op
over the selected rows.

No combination of a client's fields leaves a row without a token: `min_tokens` yields to
the grammar (when the grammar allows nothing but EOS or stop tokens, e.g. a complete
`{"type": "boolean"}` answer, they stay allowed and the request ends "stop"), and a
repetition penalty near 0 saturates at the largest finite logit instead of overflowing to
inf (whose softmax is NaN).
"""

from __future__ import annotations

import torch

from pdserve.engine.request import Request

_TINY = 1e-30  # the smallest repetition penalty applied (fp32 rounds 1e-300 to 0)


def process_logits(logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
    """logits [S, V] (one row per request in `reqs`) -> processed logits [S, V]."""
    rows = [i for i, r in enumerate(reqs) if r.processes_logits]
    if not rows:
        return logits
    logits = logits.clone()
    sel = [reqs[i] for i in rows]
    idx = torch.tensor(rows, device=logits.device)
    sub = logits.index_select(0, idx)  # [k, V]
    _penalties(sub, sel)
    _logit_bias(sub, sel)
    _grammar(sub, sel)
    _min_tokens(sub, sel)
    logits.index_copy_(0, idx, sub)
    return logits


def _padded(seqs: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(s) for s in seqs))
    return torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)


def _penalties(sub: torch.Tensor, reqs: list[Request]) -> None:
    k, vocab = sub.shape
    dev = sub.device
    rep = [r.sampling_params.repetition_penalty for r in reqs]
    if any(p != 1.0 for p in rep):
        # tokens seen in prompt or output; the pad column `vocab` is dropped
        ids = _padded([r.all_token_ids for r in reqs], vocab, dev)
        seen = torch.zeros(k, vocab + 1, dtype=torch.bool, device=dev)
        seen.scatter_(1, ids, True)
        seen = seen[:, :vocab]
        pen = torch.tensor(rep, dtype=sub.dtype, device=dev)[:, None].clamp_min(_TINY)
        penalized = torch.where(sub > 0, sub / pen, sub * pen)
        fmax = torch.finfo(sub.dtype).max
        penalized = penalized.nan_to_num(nan=-fmax, posinf=fmax, neginf=-fmax)
        sub.copy_(torch.where(seen, penalized, sub))
    freq = [r.sampling_params.frequency_penalty for r in reqs]
    pres = [r.sampling_params.presence_penalty for r in reqs]
    if any(freq) or any(pres):
        ids = _padded([r.generated_token_ids for r in reqs], vocab, dev)
        counts = torch.zeros(k, vocab + 1, dtype=sub.dtype, device=dev)
        counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=sub.dtype))
        counts = counts[:, :vocab]
        f = torch.tensor(freq, dtype=sub.dtype, device=dev)[:, None]
        p = torch.tensor(pres, dtype=sub.dtype, device=dev)[:, None]
        sub.sub_(counts * f + (counts > 0).to(sub.dtype) * p)


def _logit_bias(sub: torch.Tensor, reqs: list[Request]) -> None:
    rows, cols, vals = [], [], []
    for i, r in enumerate(reqs):
        for tok, bias in r.sampling_params.logit_bias.items():
            rows.append(i)
            cols.append(tok)
            vals.append(bias)
    if rows:
        dev = sub.device
        sub.index_put_(
            (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
            torch.tensor(vals, dtype=sub.dtype, device=dev),
            accumulate=True,
        )


def _min_tokens(sub: torch.Tensor, reqs: list[Request]) -> None:
    for i, r in enumerate(reqs):
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            barred = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            if not barred:
                continue
            if r.grammar is not None:  # yield to the grammar if it allows nothing else
                rest = sub[i].clone()
                rest[barred] = float("-inf")
                if bool(torch.isneginf(rest).all()):
                    continue
            sub[i, barred] = float("-inf")


def _grammar(sub: torch.Tensor, reqs: list[Request]) -> None:
    rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
    if not rows:
        return
    vocab = sub.shape[1]
    words = (vocab + 31) // 32
    mask = torch.zeros(len(rows), words, dtype=torch.int32)  # CPU: the matcher fills it
    for j, i in enumerate(rows):
        reqs[i].grammar.fill_bitmask(mask[j])
    allowed = _unpack_bits(mask.to(sub.device), vocab)  # [g, V] bool
    for j, i in enumerate(rows):
        allowed[j, reqs[i].grammar.extra_allowed] = True
    idx = torch.tensor(rows, device=sub.device)
    sub.index_copy_(0, idx, sub.index_select(0, idx).masked_fill(~allowed, float("-inf")))


def _unpack_bits(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[g, W] int32 bitmask (bit b of word w = token 32 w + b) -> [g, vocab] bool."""
    bit = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask[:, :, None] >> bit) & 1  # [g, W, 32]
    return bits.reshape(mask.shape[0], -1)[:, :vocab].bool()
