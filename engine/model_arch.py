"""The architecture facts the engine needs, read straight from a model's config.json.

Reading the JSON ourselves keeps `transformers` out of the engine's start-up path (its
import alone costs seconds); only exotic RoPE scalings borrow its init functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class ModelArch:
    architectures: list[str]
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    rope_parameters: dict = field(default_factory=dict)
    eos_token_id: int | list[int] | None = None
    raw: dict = field(default_factory=dict, repr=False)  # the full config.json

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelArch:
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or dict(cfg.get("rope_scaling") or {})
        rope.setdefault("rope_type", rope.get("type", "default"))
        rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        return cls(
            architectures=list(cfg.get("architectures") or []),
            model_type=cfg.get("model_type", "llama"),
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False))
            or cfg.get("model_type") == "qwen2",
            rope_parameters=rope,
            eos_token_id=cfg.get("eos_token_id"),
            raw=cfg,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelArch:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: not a Hugging Face model directory")
        return cls.from_dict(json.loads(path.read_text()))

    def to_hf_config(self):
        """The transformers config object (for RoPE types we delegate to transformers)."""
        from transformers import AutoConfig

        return AutoConfig.for_model(**self.raw)
