"""Hugging Face greedy references for token-exact comparisons."""

from __future__ import annotations

import torch


def hf_greedy(
    model, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False
) -> list[int]:
    """Greedy continuation by transformers' generate(), with an explicit attention mask."""
    ids = torch.tensor([prompt_ids])
    kwargs = {} if stop_at_eos else {"eos_token_id": None, "min_new_tokens": max_new_tokens}
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )
    return out[0, len(prompt_ids) :].tolist()


def load_hf(model_dir) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
