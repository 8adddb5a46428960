"""Structured output: one llguidance matcher per constrained request.

Why llguidance (over xgrammar and outlines-core): it has no dependencies (xgrammar pulls
torch, transformers and triton of its own choosing; outlines-core precompiles an index
over the whole vocabulary per schema, seconds for a large one), it computes each token
mask lazily in tens of microseconds on the CPU with no per-schema warm-up, and it takes
JSON schemas, Lark and regexes through one grammar format. The mask is a bitmask the
sampler unpacks for just the constrained rows (`pdserve.engine.logits_processors`).

`GrammarCompiler` compiles on worker threads (`COMPILE_WORKERS`: one slow compile does not
hold up the others; llguidance drops the GIL while it builds), with a cache keyed by
grammar, so the engine loop keeps stepping while a new schema (or, the first time, the
tokenizer view: about a second) compiles; each compile runs under `parser_limits()`
(llguidance's own fuel and size caps, checked as it works: a hostile grammar ends in an
error, not a long compile), and a request waits at most `COMPILE_DEADLINE_S` for it. A
client's grammar reaches the engine only after the node compiled it the same way in a
worker process that is killed past its deadline (`pdserve.engine.grammar_check`), so the
threads here only repeat work known to finish. `Grammar` wraps one request's matcher
(requests waiting for a compile wait in `pdserve.engine.pending_grammars`). When the grammar is complete
the request's EOS tokens are allowed (and the matcher's own EOS), so generation ends.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from pdserve.common.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

COMPILE_DEADLINE_S = 60.0  # a request waits at most this long for its grammar
COMPILE_WORKERS = 2
MAX_GRAMMAR_SIZE = 100_000  # grammar symbols (llguidance's default: 500,000)
MAX_LEXER_STATES = 50_000  # lexer states, 1-2 kB each (default: 250,000)


def parser_limits():
    """llguidance's resource caps for one grammar, for its validation and its matchers."""
    import llguidance

    return llguidance.LLParserLimits(
        max_grammar_size=MAX_GRAMMAR_SIZE, max_lexer_states=MAX_LEXER_STATES, verbose_errors=False
    )


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
    """Compiles grammars on worker threads, never on the engine loop.

    `submit(grammar)` returns a future of a template matcher, cached by the grammar text
    (the front end derives it from the schema); each request gets `instantiate(future)`,
    a deep copy, once it is done. The first submit also builds the tokenizer view (about
    a second, far longer on a loaded box). The engine waits at most `deadline_s` for a
    compile (`EngineCore` fails the request after that).
    """

    def __init__(
        self,
        model_dir: str,
        vocab_size: int,
        eos_ids: list[int],
        *,
        deadline_s: float = COMPILE_DEADLINE_S,
        executor: Executor | None = None,
        cache_size: int = 64,
    ):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.deadline_s = deadline_s
        self.cache_size = cache_size
        self._executor = executor
        self._cache: OrderedDict[str, Future] = OrderedDict()
        self._tokenizer = None  # built and read on the worker thread only

    def submit(self, grammar: str) -> Future:
        """The (maybe finished) compile of `grammar`; a failed one is retried."""
        fut = self._cache.get(grammar)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self._cache.move_to_end(grammar)
            return fut
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                COMPILE_WORKERS, thread_name_prefix="grammar-compile"
            )
        fut = self._executor.submit(self._compile, grammar)
        self._cache[grammar] = fut
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)  # its requests keep their own reference
        return fut

    def instantiate(self, fut: Future) -> Grammar:
        """A request's own matcher from a compile (raises its error; waits if unfinished)."""
        return Grammar(fut.result().deep_copy(), self.eos_ids)

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            import copy

            import llguidance

            from pdserve.engine.tokenizer import load_tokenizer

            tok = load_tokenizer(self.model_dir)
            if tok is None:
                raise InvalidRequestError("this model has no tokenizer: no structured output")
            backend = getattr(tok, "backend_tokenizer", None)
            if backend is None:
                raise InvalidRequestError("structured output needs a fast tokenizer")
            t0 = time.perf_counter()
            # as llguidance.hf.from_tokenizer does, without importing transformers
            backend = copy.copy(backend)
            backend.no_padding()
            backend.no_truncation()
            self._tokenizer = llguidance.LLTokenizer(
                backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_ids
            )
            logger.info("grammar tokenizer view built in %.1f s", time.perf_counter() - t0)
        return self._tokenizer

    def _compile(self, grammar: str):
        """A template matcher (worker thread); an invalid grammar is an InvalidRequestError."""
        import llguidance

        matcher = llguidance.LLMatcher(
            self._llg_tokenizer(), grammar, log_level=0, limits=parser_limits()
        )
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid structured-output grammar: {matcher.get_error()}", "response_format"
            )
        return matcher
