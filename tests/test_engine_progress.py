"""A decode node whose only request waits for its KV is busy, not stuck: its engine loop
runs (polling the transfer) without producing tokens, and `/v1/node` must show that, or a
router with `engine_stuck_after_s` takes a healthy node out of service while it waits
within its own deadline (`kv_transfer.transfer_timeout_s`). Real nodes (tiny Llama, real
NIXL, real HTTP); the prefill node is frozen (SIGSTOP) so the KV never comes until the
decode node's peer timeout fails the request over to a local prefill.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from tests.servers import descendants, free_port, kill_server, start_server, wait_idle

pytest.importorskip("nixl")

COMMON = ["--num-threads", "1", "--log-level", "warning", "--num-blocks", "64"]
# longer than `local_prefill_max_tokens` (16): the decode node asks the prefill node
BODY = {"prompt": list(range(5, 45)), "max_tokens": 4, "temperature": 0, "ignore_eos": True}


def signal_tree(pid: int, sig: int) -> None:
    for p in [pid, *descendants(pid)]:
        os.kill(p, sig)


def test_a_node_waiting_for_kv_shows_progress_and_an_idle_one_none(tiny_llama_dir):
    ctl = f"tcp://127.0.0.1:{free_port()}"
    common = ["--model", tiny_llama_dir, *COMMON]
    _, pproc = start_server([*common, "--role", "prefill", "--kv-control", ctl])
    durl, dproc = start_server(
        [*common, "--role", "decode", "--prefill-node", ctl, "--kv-peer-timeout", "8",
         "--kv-abort-grace", "0.5"]
    )  # fmt: skip
    try:
        assert httpx.post(f"{durl}/v1/completions", json=BODY, timeout=60).status_code == 200
        signal_tree(pproc.pid, signal.SIGSTOP)
        answers: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: answers.append(
                httpx.post(
                    f"{durl}/v1/completions",
                    json=BODY | {"prompt": list(range(50, 90))},
                    timeout=120,
                )
            )
        )
        try:
            sender.start()
            seen: list[tuple[float, int, bool]] = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < 5.0:  # well inside the 8 s peer timeout
                engine = httpx.get(f"{durl}/v1/node", timeout=5).json()["engine"]
                seen.append((time.monotonic() - t0, engine["steps"], engine["busy"]))
                time.sleep(0.2)
            # /debug/engine names the request and where it waits, in both processes
            debug = httpx.get(f"{durl}/debug/engine", timeout=5).json()
        finally:
            signal_tree(pproc.pid, signal.SIGCONT)
        (held,) = debug["requests"]
        assert held["queue"] == "waiting_for_kv" and held["remote_prefill"] == ctl, held
        assert held["prompt_tokens"] == 40 and held["output_tokens"] == 0
        assert held["max_tokens"] == 4 and held["age_s"] > 4.0
        assert [rid.split("-")[0] for rid in debug["open_here"]] == ["cmpl"], debug
        assert held["request_id"].startswith(debug["open_here"][0])
        sender.join(120)
        assert answers and answers[0].status_code == 200, answers
        waiting = [(t, steps) for t, steps, busy in seen if busy and t > 0.5]
        assert waiting and waiting[-1][0] - waiting[0][0] > 3.0, seen  # it did wait
        advanced = len({steps for _, steps in waiting})
        assert advanced >= 3, f"steps froze while the node waited for KV: {seen}"

        wait_idle(durl, timeout_s=60)
        idle = [httpx.get(f"{durl}/v1/node", timeout=5).json()["engine"] for _ in range(2)]
        time.sleep(2.5)
        idle.append(httpx.get(f"{durl}/v1/node", timeout=5).json()["engine"])
        assert not any(e["busy"] for e in idle)
        assert idle[-1]["steps"] == idle[0]["steps"], idle  # no heartbeats when idle
    finally:
        kill_server(dproc)
        kill_server(pproc)
