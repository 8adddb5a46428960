"""Load a model directory's tokenizer and apply its chat template."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.common.chat_template import SPECIAL_TOKENS, ChatTemplate


class FastTokenizer:
    """A model directory's `tokenizer.json` through `tokenizers`, with what the node takes
    from a Hugging Face fast tokenizer: `encode`, `decode`, `backend_tokenizer`,
    `chat_template` and the special tokens. Importing transformers cost a node ~3 s of CPU
    at each start (and each grammar worker as much); this imports neither it nor torch.
    Used where the directory's config asks no clean-up of decoded text, where a fast
    tokenizer's `encode` and `decode` are its backend's (tests/test_tokenizer.py)."""

    def __init__(self, model_dir: str | Path, config: dict):
        from tokenizers import Tokenizer

        d = Path(model_dir)
        self.backend_tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.clean_up_tokenization_spaces = False
        template = ChatTemplate.from_model_dir(d)
        self.chat_template = template.source if template is not None else None
        special = template.special_tokens if template is not None else {}
        for k in SPECIAL_TOKENS:
            setattr(self, k, special.get(k))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def fast_path(config: dict) -> bool:
    """Whether `FastTokenizer` equals transformers' tokenizer for this `tokenizer_config.json`:
    clean-up off, said outright, or left to transformers 5's default (its own configs)."""
    cleanup = config.get("clean_up_tokenization_spaces")
    return cleanup is False or (cleanup is None and config.get("backend") == "tokenizers")


def load_tokenizer(model_dir: str | Path, hf: bool = False):
    """The directory's tokenizer (`FastTokenizer` where it equals transformers', else, or
    with `hf`, a Hugging Face tokenizer), or None if it ships none."""
    d = Path(model_dir)
    if not (d / "tokenizer.json").exists() and not (d / "tokenizer_config.json").exists():
        return None
    path = d / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    if not hf and (d / "tokenizer.json").is_file() and fast_path(config):
        return FastTokenizer(d, config)
    return load_hf_tokenizer(d)


def load_hf_tokenizer(model_dir: str | Path):
    """transformers' tokenizer of the directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def apply_chat_template(
    tokenizer, messages: list[dict], add_generation_prompt: bool = True, **kwargs
) -> list[int]:
    """Token ids of the chat prompt, ending with the assistant's generation prompt.

    Rendered by the shared renderer (`pdserve.common.chat_template`, as the router renders
    it), then encoded without adding special tokens. `kwargs` go to the template (e.g.
    `tools`)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat messages cannot be used")
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):  # named templates: use the default one
        source = source.get("default")
    if source is None:
        raise ValueError("this model's tokenizer has no chat template")
    special = {k: getattr(tokenizer, k, None) for k in SPECIAL_TOKENS}
    text = ChatTemplate(source, special).render(messages, add_generation_prompt, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)
