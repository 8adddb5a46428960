"""Load a model directory's tokenizer and apply its chat template."""

from __future__ import annotations

from pathlib import Path


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
    `kwargs` go to the template (e.g. `tools`)."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer, so chat messages cannot be used")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("this model's tokenizer has no chat template")
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)
