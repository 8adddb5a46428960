"""The router's tokenizer: Hugging Face `tokenizers` + the model's Jinja chat template.

The router must not import torch, and `transformers.AutoTokenizer` does, so this module
reads the same files directly: `tokenizer.json` (the fast tokenizer), the chat template
and special tokens from `tokenizer_config.json`, and the vocabulary size from
`config.json`. The template is rendered as transformers renders it (sandboxed Jinja,
`trim_blocks`, `lstrip_blocks`, `loopcontrols`, `raise_exception`, `tojson`) and encoded
without adding special tokens, so the ids equal the node's (tests/test_router_tokenizer.py).

A model given by built-in name or `.gguf` is resolved (and converted once, if needed) by
`pdserve.common.model_files` in a child process, so this process never loads the engine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

_RESOLVE = "import sys; from pdserve.common.model_files import resolve_model; print(resolve_model(sys.argv[1]))"


def resolve_model_dir(name_or_path: str, timeout_s: float = 900.0) -> Path:
    """The HF-format directory of a model, resolving built-in names and GGUFs in a child."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path.resolve()
    out = subprocess.run(
        [sys.executable, "-c", _RESOLVE, name_or_path],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=Path(__file__).resolve().parent.parent,
    )
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        raise ValueError(f"cannot resolve model {name_or_path!r}: {lines[-1] if lines else ''}")
    return Path(out.stdout.strip().splitlines()[-1])


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in some tokenizer configs
        return value.get("content")
    return value


class RouterTokenizer:
    """Encode text and chat conversations exactly as the node does."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.special = {
            k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template: str | None = template or None  # its source
        self._template = _compile(template) if template else None

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of the chat prompt, ending with the assistant's generation prompt."""
        if self._template is None:
            raise ValueError("this model's tokenizer has no chat template")
        text = self._template.render(
            messages=messages, add_generation_prompt=True, tools=tools, documents=None,
            **self.special,
        )  # fmt: skip
        return self.encode(text)


def load_router_tokenizer(model_dir: str | Path) -> RouterTokenizer | None:
    """The directory's tokenizer, or None when it ships none (token-id prompts only)."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    return RouterTokenizer(model_dir)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
