"""resolve_model: built-in GGUF conversion and its cache, HF dirs, bad inputs, races, crashes."""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pdserve.common import model_files
from pdserve.common.model_files import (
    BUILTIN_MODELS,
    default_cache_dir,
    existing_model_dir,
    resolve_model,
)

BUILTIN = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    # The shared cache (PDSERVE_CACHE_DIR or ~/.cache/pdserve): converted once, reused by later runs.
    return resolve_model(BUILTIN)


def _fake_convert(calls: list[Path], seconds: float = 0.0):
    lock = threading.Lock()

    def convert(gguf: Path, out: Path, expected: dict) -> None:
        with lock:
            calls.append(out)
        time.sleep(seconds)
        (out / "config.json").write_text("{}")

    return convert


@pytest.fixture
def fake_gguf(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF not really")
    return path


@pytest.mark.slow
def test_builtin_converts_to_complete_hf_dir(smollm2_dir: Path) -> None:
    assert smollm2_dir.parent == default_cache_dir().expanduser().resolve() / "models"
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (smollm2_dir / name).is_file(), name
    assert list(smollm2_dir.glob("*.safetensors"))
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    for key, want in BUILTIN_MODELS[BUILTIN].expected_config.items():
        assert config[key] == want, key
    template = json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|im_start|>" in template


@pytest.mark.slow
def test_second_resolve_reuses_cache(smollm2_dir: Path, monkeypatch) -> None:
    before = smollm2_dir.stat()

    def no_conversion(*args):
        raise AssertionError("cached model was converted again")

    monkeypatch.setattr(model_files, "_convert", no_conversion)
    again = resolve_model(BUILTIN)
    after = again.stat()
    assert again == smollm2_dir
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


@pytest.mark.slow
def test_converted_model_answers_chat_question(smollm2_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    input_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    # The pad id (<|im_end|>) occurs in every chat prompt: pass the mask, never let it be inferred.
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=20, do_sample=False
    )
    text = tokenizer.decode(out[0, input_ids.shape[1] :], skip_special_tokens=True)
    assert "The capital of France is Paris." in text


def test_hf_dir_is_returned_absolute(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("m") == tmp_path.resolve() / "m"


def test_unknown_name_lists_builtins() -> None:
    with pytest.raises(ValueError, match="no-such-model") as excinfo:
        resolve_model("no-such-model")
    assert BUILTIN in str(excinfo.value)


def test_dir_without_config_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_default_cache_dir_honours_env(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "pdserve"


def test_concurrent_resolves_convert_once(fake_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "_convert", _fake_convert(calls, seconds=0.5))
    with ThreadPoolExecutor(4) as pool:  # each thread opens its own lock file: flock excludes
        paths = list(pool.map(lambda _: resolve_model(str(fake_gguf), tmp_path / "c"), range(4)))
    assert len(calls) == 1
    assert len(set(paths)) == 1 and (paths[0] / "config.json").is_file()
    assert paths[0].name.startswith("tiny-")
    assert not list((tmp_path / "c" / "models").glob(".*tmp-*"))


def test_failed_conversion_leaves_no_cache_entry(
    fake_gguf: Path, tmp_path: Path, monkeypatch
) -> None:
    def crash(gguf: Path, out: Path, expected: dict) -> None:
        (out / "config.json").write_text("{}")  # half-written
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_files, "_convert", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(str(fake_gguf), tmp_path / "c")
    models = tmp_path / "c" / "models"
    (lock,) = models.iterdir()  # only the lock file: no model dir, no temp dir
    assert lock.name.endswith(".lock")

    # A temp dir left by a killed converter (no cleanup ran) is swept by the next conversion.
    stale = models / f"{lock.name.removesuffix('.lock')}.tmp-killed"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "_convert", _fake_convert(calls))
    out = resolve_model(str(fake_gguf), tmp_path / "c")
    assert len(calls) == 1 and (out / "config.json").is_file()
    assert not stale.exists()


def test_gguf_cache_key_follows_file_changes(fake_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "_convert", _fake_convert(calls))
    first = resolve_model(str(fake_gguf), tmp_path / "c")
    assert resolve_model(str(fake_gguf), tmp_path / "c") == first
    st = fake_gguf.stat()
    os.utime(fake_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert resolve_model(str(fake_gguf), tmp_path / "c") != first
    assert len(calls) == 2


def test_existing_model_dir_never_converts(fake_gguf: Path, tmp_path: Path, monkeypatch) -> None:
    """What a node's HTTP process uses to load the tokenizer while its engine starts: the
    directory `resolve_model` gives, only where nothing needs converting."""
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "_convert", _fake_convert(calls))
    cache = tmp_path / "c"
    assert existing_model_dir(str(fake_gguf), cache) is None  # not converted yet
    assert not calls and not (cache / "models").exists()  # and nothing was done
    converted = resolve_model(str(fake_gguf), cache)
    assert existing_model_dir(str(fake_gguf), cache) == converted
    assert existing_model_dir(str(converted)) == converted  # a model directory
    assert existing_model_dir(str(tmp_path / "nowhere")) is None
    assert existing_model_dir("no-such-builtin") is None
    assert len(calls) == 1


@pytest.mark.slow
def test_existing_model_dir_of_the_builtin_is_its_conversion(smollm2_dir: Path) -> None:
    assert existing_model_dir(BUILTIN) == smollm2_dir
