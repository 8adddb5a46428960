"""Incremental detokenizer with the real SmolLM2 tokenizer: UTF-8 safety and exact stop strings."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer

pytestmark = pytest.mark.slow

TEXT = "Grüße aus Köln! 日本語のテキスト 🎉🦜 naïve café — fin. The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tokenizer():
    from pdserve.common.model_files import resolve_model
    from pdserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model("smollm2-135m-instruct"), hf=True)


def stream(
    tokenizer, ids: list[int], stop: list[str] | None = None
) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed one token at a time, as the engine delivers them; return every delta."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for i, t in enumerate(ids):
        deltas.append(detok.update([t], final=i == len(ids) - 1))
        if detok.stopped:
            break
    return deltas, detok


def test_multibyte_characters_split_across_tokens_are_never_broken(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The text really exercises the hold-back: some tokens are partial UTF-8 characters.
    partial = [t for t in ids if "\ufffd" in tokenizer.decode([t])]
    assert len(partial) >= 4
    deltas, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == TEXT
    # Every character was released as soon as its last byte arrived: no delta is held
    # back past the token that completes it, so the text grows monotonically.
    assert sum(1 for d in deltas if d) >= len(ids) - len(partial)


def test_streamed_text_equals_full_decode_for_random_tokens(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(40)]
        deltas, _ = stream(tokenizer, ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


def test_fast_path_decodes_as_the_tokenizer_does(tokenizer):
    """SmolLM2's tokenizer takes the backend path (no clean-up); it and the wrapper path
    stream the same text, and both equal the tokenizer's own decode of the whole output."""
    assert tokenizer.clean_up_tokenization_spaces is False
    rng = random.Random(1)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    ids += [rng.randrange(tokenizer.vocab_size) for _ in range(200)]
    ids += tokenizer.encode("<|im_end|> tail", add_special_tokens=False)

    class Wrapped:  # the tokenizer without its backend: only `decode` is left
        def decode(self, ids, skip_special_tokens=False):
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    fast, _ = stream(tokenizer, ids)
    slow, _ = stream(Wrapped(), ids)
    assert fast == slow
    assert "".join(fast) == tokenizer.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Hello there", add_special_tokens=False)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    deltas, _ = stream(tokenizer, ids + [eos])
    assert "".join(deltas) == "Hello there"


@pytest.mark.parametrize(
    "stop",
    [
        ["own fox j"],  # spans several tokens, starts mid-token
        ["日本"],  # multibyte, split across byte tokens
        ["🦜"],
        ["lazy dog.", "naïve"],  # the earliest occurrence wins, whatever the list order
        ["Grü"],  # at the very start: nothing is sent
    ],
)
def test_stop_strings_cut_exactly(tokenizer, stop):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    expected = TEXT[: min(TEXT.index(s) for s in stop)]
    deltas, detok = stream(tokenizer, ids, stop)
    assert detok.stopped
    assert "".join(deltas) == expected
    # Nothing at or after the stop string was ever sent, not even a piece of it.
    sent = ""
    for d in deltas:
        sent += d
        assert expected.startswith(sent)


def test_partial_stop_match_is_held_then_released(tokenizer):
    text = "The quick brown fox"
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, detok = stream(tokenizer, ids, ["brown cat"])
    assert not detok.stopped
    assert "".join(deltas) == text
    # "brown" (a prefix of the stop string) was held until " fox" ruled the stop out.
    assert deltas[-1] == "brown fox"
    assert not "".join(deltas[:-1]).endswith("brown")


def test_stop_found_in_last_batch_of_tokens(tokenizer):
    # A slow consumer hands the detokenizer many tokens at once, the last call final.
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ["fin."])
    text = detok.update(ids[:5]) + detok.update(ids[5:], final=True)
    assert detok.stopped
    assert text == TEXT[: TEXT.index("fin.")]


@pytest.mark.parametrize("stop", [None, ["Köln! 日"], ["🦜 na"]])
def test_a_resumed_stream_goes_on_at_every_boundary(tokenizer, stop):
    """A migrated request: the first node streamed k tokens (its client got their text),
    a new detokenizer resumes from those k tokens and the characters sent; together they
    send exactly the unbroken stream's text, whether the boundary splits a multibyte
    character or falls inside a stop string."""
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    whole, whole_detok = stream(tokenizer, ids, stop)
    want = "".join(whole)
    for k in range(1, len(ids)):
        first = IncrementalDetokenizer(tokenizer, stop)
        sent = "".join(first.update([t]) for t in ids[:k])
        if first.stopped:
            break
        second = IncrementalDetokenizer(tokenizer, stop)
        second.resume(ids[:k], len(sent))
        rest = []
        for i, t in enumerate(ids[k:]):
            rest.append(second.update([t], final=k + i == len(ids) - 1))
            if second.stopped:
                break
        assert sent + "".join(rest) == want, f"boundary after token {k}"
        assert second.stopped == whole_detok.stopped
