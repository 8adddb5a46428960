"""The shared chat-template renderer writes what transformers' `apply_chat_template` writes."""

from __future__ import annotations

import pytest

from pdserve.common.chat_template import SPECIAL_TOKENS, ChatTemplate
from pdserve.common.model_files import resolve_model
from pdserve.engine.tokenizer import apply_chat_template, load_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And grass? Ünïcödé, emoji 🙂, tabs\tand\nnewlines."},
    ],
    [{"role": "user", "content": ""}],
    [  # what api/chat_tools.py makes of a tool call and its result
        {"role": "system", "content": "You can call these functions.\n{}"},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": '<tool_call>{"name": "get_weather"}</tool_call>'},
        {"role": "tool", "content": "sunny"},
    ],
    [  # a conversation ending on the assistant's turn
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
    ],
]


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def hf(model_dir):
    return load_tokenizer(model_dir, hf=True)


def test_template_and_special_tokens_are_the_tokenizers(model_dir, hf):
    ours = ChatTemplate.from_model_dir(model_dir)
    assert ours is not None and ours.source == hf.chat_template
    assert ours.special_tokens == {k: getattr(hf, k) for k in SPECIAL_TOKENS}


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_render_equals_transformers(model_dir, hf, conv, add_generation_prompt, tools):
    ours = ChatTemplate.from_model_dir(model_dir)
    text = ours.render(conv, add_generation_prompt=add_generation_prompt, tools=tools)
    ref = hf.apply_chat_template(
        conv, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == ref


@pytest.mark.parametrize("conv", CONVERSATIONS)
def test_engine_ids_equal_transformers(hf, conv):
    ref = hf.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
    if isinstance(ref, dict) or hasattr(ref, "input_ids"):  # BatchEncoding in newer transformers
        ref = ref["input_ids"]
    assert apply_chat_template(hf, conv) == list(ref)


def test_template_errors_are_raised(hf):
    t = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(Exception, match="no system role"):
        t.render([{"role": "system", "content": "x"}])
