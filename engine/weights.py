"""Read safetensors weights from a Hugging Face directory into a model, with progress."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

logger = logging.getLogger(__name__)


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            keys = list(st.keys())
            for name in tqdm(
                keys, desc=f"loading {f.name}", unit="tensor", leave=False, disable=None
            ):
                yield name, st.get_tensor(name)


def load_model_weights(model: torch.nn.Module, model_dir: str | Path) -> None:
    model.load_weights(iter_safetensors(model_dir))
    logger.info("loaded weights from %s", model_dir)
