"""Incremental detokenization with stop strings, for streaming one request's text.

Text is decoded from a sliding window of token ids `[prefix_offset:]`: the text of the
window minus the text of its already-read part `[prefix_offset:read_offset]` is what the new
tokens add. The window keeps enough left context for tokenizers whose decoding of a token
depends on its neighbour (leading spaces, merged byte sequences). A window whose text ends
in U+FFFD is an incomplete UTF-8 character: those tokens wait for the next ones, so a
broken character is never emitted (only a request that ends mid-character flushes one,
exactly as decoding the whole output would).

Stop strings are applied to the decoded text: the first occurrence ends the request and
nothing from it onward is ever returned. Text that could be the beginning of a stop string
(a suffix of the unsent text that is a prefix of some stop string) is held back until the
next tokens decide it. Invariant: no stop string occurrence starts before `sent`.

The result equals `tokenizer.decode(all_output_ids, skip_special_tokens=True)` cut at the
earliest stop string, for tokenizers without `clean_up_tokenization_spaces`.

Such a tokenizer's `decode` is exactly its Rust backend's `decode` behind a Python wrapper
that costs ~3x the decode itself (argument conversion, keyword plumbing); every streamed
token decodes twice, so the window is decoded by the backend directly when that is the
same function (a fast tokenizer, no clean-up), and by `tokenizer.decode` otherwise.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far (cut at the stop string once one is found)
        self.sent = 0  # characters of `text` already returned
        self.stopped = False  # a stop string was found
        self._decode_ids = _decoder(tokenizer, skip_special_tokens)

    def update(self, new_token_ids: list[int], final: bool = False) -> str:
        """Add tokens; return the text that can be sent now. `final`: flush everything."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        self._decode(final)
        hold = 0
        if self.stop:
            hit = self._find_stop()
            if hit is not None:
                self.text = self.text[:hit]
                self.stopped = True
            elif not final:
                hold = self._partial_stop_len()
        end = len(self.text) - hold
        delta = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return delta

    def resume(self, token_ids: list[int], sent_chars: int) -> None:
        """Continue another detokenizer's stream (a migrated request): it had these tokens
        and had returned `sent_chars` characters. Both texts are prefixes of the same final
        text, so the next `update` returns exactly what that one would have: a character
        split across the boundary, or a stop string spanning it, is decided as one stream.
        """
        self.update(token_ids)
        self.sent = sent_chars

    @property
    def output_text(self) -> str:
        """Everything returned so far."""
        return self.text[: self.sent]

    def _decode(self, final: bool) -> None:
        ids = self.token_ids
        if self.read_offset == len(ids):
            return
        prefix_text = self._text(ids[self.prefix_offset : self.read_offset])
        new_text = self._text(ids[self.prefix_offset :])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith(_REPLACEMENT)):
            self.text += new_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)

    def _text(self, ids: list[int]) -> str:
        return self._decode_ids(ids) if ids else ""

    def _find_stop(self) -> int | None:
        hits = [i for s in self.stop if (i := self.text.find(s, self.sent)) >= 0]
        return min(hits) if hits else None

    def _partial_stop_len(self) -> int:
        unsent = self.text[self.sent :]
        longest = min(len(unsent), max(len(s) for s in self.stop) - 1)
        for k in range(longest, 0, -1):
            tail = unsent[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0


def _decoder(tokenizer, skip_special_tokens: bool):
    """ids -> text, as `tokenizer.decode(ids, skip_special_tokens=...)` returns it."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast (Rust) tokenizer
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
