"""Structured output: one llguidance matcher per constrained request.

Why llguidance (over xgrammar and outlines-core): it has no dependencies (xgrammar pulls
torch, transformers and triton of its own choosing; outlines-core precompiles an index
over the whole vocabulary per schema, seconds for a large one), it computes each token
mask lazily in tens of microseconds on the CPU with no per-schema warm-up, and it takes
JSON schemas, Lark and regexes through one grammar format. The mask is a bitmask the
sampler unpacks for just the constrained rows (`engine.logits_processors`).

`GrammarCompiler` builds the tokenizer view once per engine (about a second, on the first
constrained request); `Grammar` wraps one request's matcher. When the grammar is complete
the request's EOS tokens are allowed (and the matcher's own EOS), so generation ends.
"""

from __future__ import annotations

import logging

import torch

from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)


class Grammar:
    def __init__(self, matcher, eos_ids: list[int]):
        self.matcher = matcher
        self.eos_ids = eos_ids

    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed-token bitmask into `row` (int32, CPU, contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    @property
    def extra_allowed(self) -> list[int]:
        return self.eos_ids if self.matcher.is_accepting() else []

    def accept(self, token: int) -> None:
        if token in self.eos_ids and self.matcher.is_accepting():
            return
        if not self.matcher.consume_token(token):
            logger.warning("grammar rejected token %d: %s", token, self.matcher.get_error())


class GrammarCompiler:
    def __init__(self, model_dir: str, vocab_size: int, eos_ids: list[int]):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self._tokenizer = None

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            from engine.tokenizer import load_tokenizer

            hf = load_tokenizer(self.model_dir)
            if hf is None:
                raise InvalidRequestError("this model has no tokenizer: no structured output")
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=self.vocab_size, eos_token=self.eos_ids
            )
        return self._tokenizer

    def compile(self, grammar: str) -> Grammar:
        """A fresh matcher; an invalid grammar is an InvalidRequestError."""
        import llguidance

        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid structured-output grammar: {matcher.get_error()}", "response_format"
            )
        return Grammar(matcher, self.eos_ids)
