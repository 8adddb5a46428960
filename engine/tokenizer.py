"""Load a model directory's tokenizer and apply its chat template."""

from __future__ import annotations

from pathlib import Path

from pdserve.common.chat_template import SPECIAL_TOKENS, ChatTemplate


def load_tokenizer(model_dir: str | Path):
    """The directory's Hugging Face tokenizer, or None if it ships none."""
    d = Path(model_dir)
    if not (d / "tokenizer.json").exists() and not (d / "tokenizer_config.json").exists():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d), local_files_only=True)


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
