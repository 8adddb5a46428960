"""`pdserve bench serve` arithmetic on synthetic timings, datasets, arrivals, compare."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import RequestRecord
from pdserve.bench.datasets import (
    DatasetError,
    Tokenizer,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
)
from pdserve.bench.metrics import parse_goodput, summarize
from pdserve.bench.report import compare_table
from tests.servers import ROOT


def _rec(i, start, ttft, chunks, e2e, out, ok=True, **kw) -> RequestRecord:
    r = RequestRecord(index=i, prompt_len=10, max_tokens=out, start=start, ttft=ttft, e2e=e2e)
    r.chunk_times, r.output_tokens, r.ok = chunks, out, ok
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def test_known_timings_give_known_metrics():
    # Request 0: sent at 0, tokens at 0.1, 0.2, 0.3, 0.4 -> TTFT 100 ms, TPOT 100 ms.
    # Request 1: sent at 1, tokens at +0.5, +0.7, +0.9 -> TTFT 500 ms, TPOT 200 ms.
    # Request 2: failed (connection refused) at 2.
    recs = [
        _rec(0, 0.0, 0.1, [0.1, 0.2, 0.3, 0.4], 0.4, 4),
        _rec(1, 1.0, 0.5, [0.5, 0.7, 0.9], 0.9, 3),
        _rec(2, 2.0, None, [], 0.05, 0, ok=False, error_kind="connect", error="refused"),
    ]
    m = summarize(recs, [50, 90, 99], parse_goodput(["ttft:300", "tpot:150"]))
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["failure_reasons"] == {"connect": 1}
    assert m["failure_examples"] == {"connect": "refused"}
    assert m["duration_s"] == pytest.approx(2.05)  # first sent 0 -> last ended 2.05
    assert m["total_output_tokens"] == 7
    assert m["output_throughput"] == pytest.approx(7 / 2.05)
    assert m["request_throughput"] == pytest.approx(2 / 2.05)
    assert m["input_throughput"] == pytest.approx(20 / 2.05)
    assert m["ttft_ms"]["mean"] == pytest.approx(300)
    assert m["ttft_ms"]["median"] == pytest.approx(300)
    assert m["ttft_ms"]["p90"] == pytest.approx(100 + 0.9 * 400)
    assert m["tpot_ms"]["mean"] == pytest.approx(150)
    assert m["tpot_ms"]["max"] == pytest.approx(200)
    # ITL pools 0.1 x3 and 0.2 x2
    assert m["itl_ms"]["mean"] == pytest.approx((3 * 100 + 2 * 200) / 5)
    assert m["itl_ms"]["median"] == pytest.approx(100)
    assert m["e2el_ms"]["p99"] == pytest.approx(400 + 0.99 * 500)
    # goodput: only request 0 meets TTFT <= 300 ms and TPOT <= 150 ms
    assert m["goodput"]["good_requests"] == 1
    assert m["goodput"]["request_goodput"] == pytest.approx(1 / 2.05)
    assert m["max_concurrent_requests"] == 1


def test_stage_breakdown_and_client_overhead():
    timings = {"ttft_s": 0.08, "stages": {"queue": 0.03, "prefill": 0.05}}
    recs = [_rec(0, 0.0, 0.1, [0.1, 0.2], 0.2, 2, server_timings=timings)]
    stages = summarize(recs, [50])["ttft_stages_ms"]
    assert stages["queue"]["mean"] == pytest.approx(30)
    assert stages["prefill"]["median"] == pytest.approx(50)
    assert stages["client_overhead"]["mean"] == pytest.approx(20)


def test_empty_and_all_failed_runs_report_without_crashing():
    m = summarize([_rec(0, 0.0, None, [], 0.01, 0, ok=False, error_kind="http_500")], [99])
    assert m["completed"] == 0 and m["ttft_ms"]["p99"] is None and m["output_throughput"] == 0
    assert summarize([], [50])["num_requests"] == 0


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:-1", "tpot:abc", "e2el:inf"])
def test_bad_goodput_names_the_item(bad):
    with pytest.raises(ValueError, match=bad.split(":")[0]):
        parse_goodput([bad])


def test_arrivals_poisson_gamma_and_inf():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    a = arrival_offsets(4000, 10.0, 1.0, seed=1)
    assert a == arrival_offsets(4000, 10.0, 1.0, seed=1)  # a seed repeats the run
    gaps = np.diff(a)
    assert np.mean(gaps) == pytest.approx(0.1, rel=0.06)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: CV 1
    bursty = np.diff(arrival_offsets(4000, 10.0, 0.25, seed=1))
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(2.0, rel=0.15)  # CV 1/sqrt(k)
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0)


def test_random_and_shared_prefix_datasets():
    reqs = random_requests(50, 100, 20, 0.5, seed=3, vocab=1000)
    assert reqs == random_requests(50, 100, 20, 0.5, seed=3, vocab=1000)
    assert all(50 <= r.prompt_len <= 150 and len(r.prompt) == r.prompt_len for r in reqs)
    assert all(10 <= r.output_len <= 30 for r in reqs)
    assert all(0 <= t < 1000 for r in reqs for t in r.prompt)
    sp = shared_prefix_requests(8, 2, 64, 16, 8, seed=0, vocab=1000)
    assert [r.group for r in sp] == [0, 1] * 4
    for r in sp:
        same = [o for o in sp if o.group == r.group]
        assert all(o.prompt[:64] == r.prompt[:64] for o in same)
        assert r.prompt_len == 80
    assert sp[0].prompt[:64] != sp[1].prompt[:64]
    with pytest.raises(DatasetError, match="tokenizer"):
        random_requests(2, 10, 5, 0.0, 0, 1000, as_text=True, tok=None)


@pytest.fixture
def word_tokenizer(tmp_path) -> Tokenizer:
    from tokenizers import Tokenizer as T
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = "hello world how are you fine thanks and the a of [UNK]".split()
    tok = T(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    return Tokenizer(tmp_path)


def test_sharegpt_counts_tokens_and_skips_short(tmp_path, word_tokenizer):
    conv = [
        {"conversations": [{"from": "human", "value": "hello world how are you"},
                           {"from": "gpt", "value": "fine thanks and the a of you"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "a b c d"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
        {"bad": 1},
    ]  # fmt: skip
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(conv))
    reqs = sharegpt_requests(path, 1, seed=0, tok=word_tokenizer)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [
        ("hello world how are you", 5, 7)
    ]
    with pytest.raises(DatasetError, match="only 1 usable"):
        sharegpt_requests(path, 2, seed=0, tok=word_tokenizer)
    with pytest.raises(DatasetError, match="tokenizer"):
        sharegpt_requests(path, 1, seed=0, tok=None)


def test_compare_table_pairs_runs_with_ratios():
    def report(label, tput, ttft):
        recs = [_rec(0, 0.0, ttft, [ttft, ttft + 0.1], ttft + 0.1, 2)]
        m = summarize(recs, [50, 99])
        m["output_throughput"] = tput
        return {"label": label, "runs": [{"request_rate": "inf", "metrics": m}]}

    table = compare_table(report("vllm", 100.0, 0.2), report("pdserve", 150.0, 0.1))
    assert "| metric | vllm | pdserve | B/A |" in table
    assert "| output tok/s | 100.0 | 150.0 | 1.50 |" in table
    assert "| median TTFT (ms) | 200.0 | 100.0 | 0.50 |" in table


def test_serve_benchmark_does_not_import_torch():
    code = (
        "import sys; import pdserve.bench.cli, pdserve.bench.serve, pdserve.bench.runner, pdserve.bench.plots, pdserve.bench.compare;"
        "import pdserve.cli; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
