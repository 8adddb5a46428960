"""engine/tokenizer.py: the node's tokenizer (`tokenizers` alone, no transformers) equals
transformers' on the default model: ids, text, chat template, special tokens, and the
grammar's token view built from it."""

from __future__ import annotations

import sys

import pytest

from pdserve.common.model_files import resolve_model
from pdserve.engine.tokenizer import FastTokenizer, apply_chat_template, load_tokenizer

TEXTS = ["Hello world", "  leading spaces", "数字 123 and <|im_start|> in text", "", "a\n\n\tb",
         "emoji 🙂 and é", "<|im_end|><|im_start|>assistant\n"]  # fmt: skip


@pytest.fixture(scope="module")
def pair():
    d = resolve_model("smollm2-135m-instruct")
    return load_tokenizer(d), load_tokenizer(d, hf=True)


def test_the_node_gets_the_fast_one_and_it_equals_transformers(pair):
    fast, hf = pair
    assert isinstance(fast, FastTokenizer) and not isinstance(hf, FastTokenizer)
    assert fast.chat_template == hf.chat_template
    for k in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(fast, k) == getattr(hf, k), k
    for text in TEXTS:
        for special in (True, False):
            assert fast.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special
            )
    ids = [i for t in TEXTS for i in hf.encode(t)] + [0, 1, 2, 49151]
    for skip in (True, False):
        assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        )
    for i in ids:  # one token at a time, as logprobs show them (half a character too)
        assert fast.decode([i]) == hf.decode([i])
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    ref = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert apply_chat_template(fast, chat) == list(ref)


def test_the_node_process_imports_no_transformers():
    import subprocess

    code = ("import sys; from pdserve.common.model_files import resolve_model; "
            "from pdserve.engine.tokenizer import load_tokenizer; "
            "t = load_tokenizer(resolve_model('smollm2-135m-instruct')); t.encode('hi'); "
            "print('transformers' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_config_asking_clean_up_gets_transformers(tmp_path):
    import json
    import shutil

    src = resolve_model("smollm2-135m-instruct")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{f}", tmp_path / f)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**cfg, "clean_up_tokenization_spaces": True})
    )
    assert not isinstance(load_tokenizer(tmp_path), FastTokenizer)


def test_the_grammar_view_from_the_fast_tokenizer_equals_llguidance_hf(pair):
    """engine/grammar.py builds llguidance's token view from the fast tokenizer itself:
    the same tokens, special tokens and masks as llguidance.hf.from_tokenizer's."""
    import llguidance
    import llguidance.hf

    from pdserve.engine.grammar import GrammarCompiler

    _, hf = pair
    view = GrammarCompiler(str(resolve_model("smollm2-135m-instruct")), 49152, [2])._llg_tokenizer()
    ref = llguidance.hf.from_tokenizer(hf, n_vocab=49152, eos_token=[2])
    assert view.vocab_size == ref.vocab_size and view.eos_tokens == ref.eos_tokens
    ids = list(range(0, 49152, 97)) + [0, 1, 2]
    assert view.decode_bytes(ids) == ref.decode_bytes(ids)
    assert [view.is_special_token(i) for i in ids] == [ref.is_special_token(i) for i in ids]
    for text in TEXTS:
        assert view.tokenize_str(text) == ref.tokenize_str(text)
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "integer"})
    masks = [bytes(llguidance.LLMatcher(t, grammar).compute_bitmask()) for t in (view, ref)]
    assert masks[0] == masks[1] and any(masks[0])
