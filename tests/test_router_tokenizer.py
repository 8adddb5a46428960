"""The router's torch-free tokenizer gives the node's token ids (transformers as reference)."""

from __future__ import annotations

import pytest

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.tokenizer import RouterTokenizer, resolve_model_dir
from tests.test_chat_template import CONVERSATIONS as ALL_CONVERSATIONS

# the plain conversations of the shared renderer's test (no tool calls)
CONVERSATIONS = ALL_CONVERSATIONS[:3]


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model_dir("smollm2-135m-instruct")  # in a child process


def test_chat_template_and_encode_equal_transformers(model_dir):
    ours = RouterTokenizer(model_dir)
    ref = load_tokenizer(model_dir, hf=True)
    for conv in CONVERSATIONS:
        ids = ref.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(
            ids, "input_ids"
        ):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        assert ours.apply_chat_template(conv) == list(ids)  # transformers renders it itself
    for text in ["Hello world", "  leading spaces", "数字 123 and <|im_start|> in text", ""]:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False)


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot resolve model 'no-such-model'"):
        resolve_model_dir("no-such-model")
