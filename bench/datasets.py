"""The prompts a serving benchmark sends: random, shared-prefix, or a ShareGPT JSON file.

Every dataset is a list of `BenchRequest`s, fixed by the seed. Prompts are token id lists
when the lengths must be exact (random, shared-prefix on /v1/completions: every OpenAI
server takes a token id prompt there) and text otherwise (chat endpoints, ShareGPT).
Token counts come from the model's tokenizer, loaded with `tokenizers` (no torch).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # tokens, as the dataset counted them
    output_len: int  # max_tokens asked for
    group: int = 0  # shared-prefix: which prefix group


class DatasetError(ValueError):
    """A dataset option or file that cannot give the requested prompts."""


class Tokenizer:
    """The model's tokenizer (a `tokenizer.json`), through the `tokenizers` library."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        p = Path(path).expanduser()
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise DatasetError(f"tokenizer: no tokenizer.json at {path!r}")
        self._tok = _Tok.from_file(str(file))
        self.path = str(file)
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def count(self, text: str) -> int:
        return len(self.encode(text))


def resolve_tokenizer(name: str | None) -> Tokenizer | None:
    """A tokenizer path, a pdserve built-in model name, or None for no tokenizer."""
    if not name:
        return None
    if Path(name).expanduser().exists():
        return Tokenizer(name)
    from pdserve.common.model_files import BUILTIN_MODELS, resolve_model  # light: no torch import

    if name in BUILTIN_MODELS:
        return Tokenizer(resolve_model(name))
    raise DatasetError(f"tokenizer {name!r}: not a path nor a built-in model name")


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    """n lengths uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1."""
    if not 0 <= ratio < 1:
        raise DatasetError(f"range ratio {ratio} must be in [0, 1)")
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def _random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    # Skip the lowest ids: real vocabularies keep their special tokens there.
    low = min(100, vocab // 4)
    return rng.integers(low, vocab, size=n).tolist()


def _as_prompt(ids: list[int], as_text: bool, tok: Tokenizer | None) -> str | list[int]:
    if not as_text:
        return ids
    if tok is None:
        raise DatasetError("text prompts (a chat endpoint) need --tokenizer")
    return tok.decode(ids)


def random_requests(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    vocab: int,
    as_text: bool = False,
    tok: Tokenizer | None = None,
) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    ins = _lengths(rng, input_len, range_ratio, n)
    outs = _lengths(rng, output_len, range_ratio, n)
    return [
        BenchRequest(_as_prompt(_random_ids(rng, i, vocab), as_text, tok), i, o)
        for i, o in zip(ins, outs)
    ]


def shared_prefix_requests(
    n: int,
    num_groups: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    seed: int,
    vocab: int,
    as_text: bool = False,
    tok: Tokenizer | None = None,
) -> list[BenchRequest]:
    """`num_groups` long system prompts; each request is one of them plus its own suffix.

    Requests are interleaved across groups (0, 1, ..., 0, 1, ...): prefix reuse has to come
    from the cache, not from the same prompt arriving twice in a row.
    """
    if num_groups < 1:
        raise DatasetError("shared-prefix: --num-groups must be >= 1")
    rng = np.random.default_rng(seed)
    prefixes = [_random_ids(rng, prefix_len, vocab) for _ in range(num_groups)]
    out = []
    for i in range(n):
        g = i % num_groups
        ids = prefixes[g] + _random_ids(rng, input_len, vocab)
        out.append(BenchRequest(_as_prompt(ids, as_text, tok), len(ids), output_len, g))
    return out


def sharegpt_requests(
    path: str | Path,
    n: int,
    seed: int,
    tok: Tokenizer | None,
    output_len: int | None = None,
    max_len: int = 2048,
) -> list[BenchRequest]:
    """The first human turn of ShareGPT conversations, the gpt answer's length as output.

    Conversations with a prompt or answer under 4 tokens, or longer than `max_len` together,
    are skipped. The selection is a seeded shuffle, so a seed gives the same prompts.
    """
    if tok is None:
        raise DatasetError("sharegpt needs --tokenizer to count prompt and answer tokens")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DatasetError(f"sharegpt file {path!r}: {e}") from e
    if not isinstance(data, list):
        raise DatasetError(f"sharegpt file {path!r}: expected a JSON list of conversations")
    order = np.random.default_rng(seed).permutation(len(data))
    out: list[BenchRequest] = []
    for idx in order:
        turns = data[idx].get("conversations") if isinstance(data[idx], dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        prompt, answer = turns[0].get("value"), turns[1].get("value")
        if not isinstance(prompt, str) or not isinstance(answer, str):
            continue
        p_len = tok.count(prompt)
        o_len = output_len if output_len is not None else tok.count(answer)
        if p_len < 4 or o_len < 4 or p_len + o_len > max_len:
            continue
        out.append(BenchRequest(prompt, p_len, o_len))
        if len(out) == n:
            break
    if len(out) < n:
        raise DatasetError(f"sharegpt file {path!r}: only {len(out)} usable conversations")
    return out
