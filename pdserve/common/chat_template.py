"""Render a model's Jinja chat template: the one renderer of the engine, the node and the router.

The template is rendered as transformers renders it (sandboxed Jinja with `trim_blocks`,
`lstrip_blocks`, `loopcontrols`, `raise_exception`, `strftime_now`, a `tojson` that keeps
non-ASCII text), with the tokenizer's special tokens (`bos_token`, ...) in scope, so the
text equals `tokenizer.apply_chat_template(..., tokenize=False)` (tests/test_chat_template.py).
The caller encodes the text without adding special tokens: the template writes them.
Light (jinja2 only): the router uses it without torch or transformers.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplate:
    """A compiled chat template and the special tokens it sees."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self._template = _compile(source)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template in the directory's `tokenizer_config.json`, or None if it has none."""
        path = Path(model_dir) / "tokenizer_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: use the default one
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        return cls(source, {k: _token_text(cfg.get(k)) for k in SPECIAL_TOKENS})

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        **kwargs,
    ) -> str:
        """The prompt text of `messages`; with `add_generation_prompt`, it ends with the
        assistant's turn opening. `kwargs` reach the template (as transformers passes them)."""
        return self._template.render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **kwargs},
        )


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in some tokenizer configs
        return value.get("content")
    return value


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
