"""The router's tokenizer: Hugging Face `tokenizers` + the shared chat-template renderer.

The router must not import torch, and `transformers.AutoTokenizer` does, so this module
reads the same files directly: `tokenizer.json` (the fast tokenizer) and the chat template
with its special tokens (`pdserve.common.chat_template`, the renderer the node uses too).
Text is encoded without adding special tokens, so the ids equal the node's
(tests/test_router_tokenizer.py).

A model given by built-in name or `.gguf` is resolved (and converted once, if needed) by
`pdserve.common.model_files` in a child process, so this process never runs a conversion.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer

from pdserve.common.chat_template import ChatTemplate
from pdserve.common.off_loop import INLINE_CHARS

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


class RouterTokenizer:
    """Encode text and chat conversations exactly as the node does."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.template = ChatTemplate.from_model_dir(d)
        self.chat_template: str | None = self.template.source if self.template else None

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. A long text goes through `encode_batch`, which releases
        the GIL while it works (`encode` holds it): run on a worker thread
        (pdserve/common/off_loop.py), it leaves the event loop free meanwhile."""
        if len(text) > INLINE_CHARS:
            return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of the chat prompt, ending with the assistant's generation prompt."""
        if self.template is None:
            raise ValueError("this model's tokenizer has no chat template")
        text = self.template.render(messages, add_generation_prompt=True, tools=tools)
        return self.encode(text)


def load_router_tokenizer(model_dir: str | Path) -> RouterTokenizer | None:
    """The directory's tokenizer, or None when it ships none (token-id prompts only)."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        return None
    return RouterTokenizer(model_dir)
