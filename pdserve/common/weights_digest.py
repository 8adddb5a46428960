"""A model's identity by content: a digest of its weights and config.

KV computed by one checkpoint is wrong for another, whatever they are called: a base model
and its fine-tune served under one name, or weights replaced in place. So the block-hash
root (pdserve/common/block_hash.py) and the shared store's namespace are keyed by
`weights_digest(model_dir)`, not by the name alone.

The digest is blake2b over `config.json` and every weight file (`*.safetensors`, `*.bin`,
`*.gguf`), names and bytes, in name order. Reading a model's bytes costs a second or so
for a small one, so it is computed once and cached beside the model in
`.pdserve-weights-digest.json` (under `$PDSERVE_CACHE_DIR/digests/` when the model's folder
is read-only), keyed by each file's size and modification time: a file rewritten in place
changes the key, and the digest is computed again. Stdlib only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_NAME = ".pdserve-weights-digest.json"
DIGEST_BYTES = 16
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


def _files(model_dir: Path) -> list[Path]:
    files = [p for p in model_dir.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES]
    return sorted(files + [model_dir / "config.json"], key=lambda p: p.name)


def _stamp(files: list[Path]) -> dict[str, list[int]]:
    return {p.name: [(st := p.stat()).st_size, st.st_mtime_ns] for p in files}


def _cache_files(model_dir: Path) -> list[Path]:
    key = hashlib.blake2b(str(model_dir).encode(), digest_size=8).hexdigest()
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    return [model_dir / CACHE_NAME, root.expanduser() / "digests" / f"{key}.json"]


def weights_digest(model_dir: str | os.PathLike) -> str:
    """Hex digest of the model's config and weights (cached while the files are unchanged).
    A `.gguf` file is digested as it is."""
    path = Path(model_dir).resolve()
    if path.is_file():  # a .gguf
        files, folder = [path], path.parent
    else:
        files, folder = _files(path), path
    stamp = _stamp(files)
    for cache in _cache_files(folder):
        try:
            saved = json.loads(cache.read_text())
            if saved.get("files") == stamp and saved.get("model") == str(path):
                return saved["digest"]
        except (OSError, ValueError, KeyError, AttributeError):
            continue
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    record = json.dumps({"model": str(path), "files": stamp, "digest": digest})
    for cache in _cache_files(folder):
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
            tmp.write_text(record)
            tmp.replace(cache)
            break
        except OSError:
            continue
    logger.info("weights digest of %s: %s", path, digest)
    return digest
