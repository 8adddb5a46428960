"""The compile cache directory (`--compile-cache-dir`, engine/compiled_model.py
`set_compile_cache_dir`): one that cannot be created (a file in the way, a read-only
mount) does not stop the engine, which logs why and serves the eager step, token for token
equal to Hugging Face greedy."""

import logging

from pdserve.engine import LLM, SamplingParams
from tests.hf_reference import hf_greedy, load_hf


def test_unusable_compile_cache_dir_logs_and_serves_eager(tiny_llama_dir, tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would go")
    with caplog.at_level(logging.ERROR, logger="pdserve.engine.model_runner"):
        llm = LLM(
            tiny_llama_dir,
            block_size=4,
            num_blocks=64,
            max_num_seqs=2,
            enforce_eager=False,
            compile_cache_dir=str(blocker / "compile"),
        )
    assert llm.engine.runner.model.compiled_decode is None  # served eager
    assert "running eager" in caplog.text and "not-a-dir" in caplog.text
    prompt = [5, 17, 99, 3]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(load_hf(tiny_llama_dir), prompt, 4)
    llm.engine.check_integrity()
