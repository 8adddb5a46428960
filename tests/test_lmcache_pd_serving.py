"""PD through the LMCache connector across processes: a prefill node and a decode node
started with `--kv-connector lmcache`, sharing one real redis-server (real SmolLM2, real
HTTP), checked against the offline colocated engine and Hugging Face.
"""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import SamplingParams
from tests.hf_reference import hf_greedy, load_hf
from tests.servers import free_port, kill_server, start_server, wait_idle
from tests.test_pd_serving import COMMON, LONG_TEXT, complete, text_prompt

pytestmark = pytest.mark.slow
pytest.importorskip("lmcache")


@pytest.fixture(scope="module")
def offline():
    from pdserve.engine import LLM

    return LLM("smollm2-135m-instruct", kv_cache_bytes=128 << 20, num_threads=1)


def test_pd_via_lmcache_equals_colocated_and_hf(redis_server, offline):
    store = ["--kv-connector", "lmcache", "--kv-store-url", redis_server.url]
    store += ["--kv-store-chunk-size", "64", "--kv-transfer-timeout", "600"]  # busy box
    ctl = f"tcp://127.0.0.1:{free_port()}"
    procs = []
    try:
        _, p = start_server([*COMMON, *store, "--role", "prefill", "--kv-control", ctl])
        procs.append(p)
        url, d = start_server([*COMMON, *store, "--role", "decode", "--prefill-node", ctl])
        procs.append(d)
        chat = offline.tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        ids = [text_prompt(offline, t) for t in (chat, LONG_TEXT)]
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        refs = [o.token_ids for o in offline.generate(ids, params)]
        hf = load_hf(offline.engine.model_dir)
        for p_ids, ref in zip(ids, refs):
            assert hf_greedy(hf, p_ids, 12) == ref
            out = complete(url, p_ids, max_tokens=12)
            assert out["choices"][0]["text"] == offline.tokenizer.decode(
                ref, skip_special_tokens=True
            )
        stats = wait_idle(url)
        assert stats["pd_remote_prefills"] == 2 and stats["pd_failures"] == 0
        assert stats["kv_bytes_received"] > 0
    finally:
        for proc in procs:
            kill_server(proc)
