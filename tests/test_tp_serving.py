"""A tensor-parallel node as a real `pdserve serve --tensor-parallel-size 2` process under
the launcher's supervisor: it serves greedy tokens equal to transformers; SIGKILL of one
rank's worker under load gives every request a terminal answer, takes the node down, the
supervisor restarts it and it serves again; nothing is left behind."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

from pdserve.cluster.launcher import http_healthy
from pdserve.cluster.process import ManagedProcess
from pdserve.cluster.schema import RestartSection
from pdserve.cluster.supervisor import Service, Supervisor
from tests.hf_reference import hf_greedy, load_hf
from tests.servers import alive, descendants, free_port


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def tp_workers(node_pid: int) -> list[int]:
    """The node's TP worker processes: spawned children of its engine process."""
    out = []
    for pid in descendants(node_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"spawn_main" in cmd and _ppid(pid) != node_pid:
                out.append(pid)
        except OSError:
            continue
    return out


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 120) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}  # fmt: skip
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def token_ids(r: httpx.Response) -> list[int]:
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_tp_node_serves_and_a_killed_worker_restarts_it(tiny_llama_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pdserve", "serve", "--model", tiny_llama_dir, "--port",
            str(port), "--tensor-parallel-size", "2", "--num-threads", "2", "--num-blocks",
            "256", "--max-model-len", "512", "--log-level", "warning"]  # fmt: skip
    proc = ManagedProcess(argv, tmp_path / "node.log")
    svc = Service("tp-0", "node", proc, http_healthy(url), url, str(proc.log_path))
    said: list[str] = []
    sup = Supervisor(
        [[svc]],
        RestartSection(backoff_s=0.2),
        startup_timeout_s=300,
        drain_timeout_s=2,
        say=said.append,
        kill_margin_s=0,
    )
    seen: set[int] = set()
    try:
        sup.start_all()
        first = proc.pid
        workers = tp_workers(first)
        assert len(workers) == 1, workers
        seen |= {first, *descendants(first)}
        prompt = [(7 * i) % 1000 + 3 for i in range(40)]
        r = complete(url, prompt, 8)
        assert r.status_code == 200, r.text
        ref = hf_greedy(load_hf(tiny_llama_dir), prompt, 8)
        assert token_ids(r) == ref

        # under load: 6 long requests running when the worker is killed
        answers: list[httpx.Response | Exception] = []

        def one(i: int) -> None:
            try:
                answers.append(complete(url, [5 + i, 6, 7, 8], 400, timeout=60))
            except Exception as e:  # noqa: BLE001 (recorded and asserted below)
                answers.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/debug/engine", timeout=30).json()["stats"]["num_running"] < 6:
            assert time.monotonic() < deadline, "the load never ran"
            time.sleep(0.05)
        os.kill(workers[0], signal.SIGKILL)
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a request got no terminal answer"
        # every request ended with an OpenAI-style error (none ran its 400 tokens by then)
        for a in answers:
            assert isinstance(a, httpx.Response), a
            assert a.status_code >= 500 and "error" in a.json(), a.text
        # the node went down, and the supervisor restarts it
        deadline = time.monotonic() + 300
        while not (proc.pid != first and svc.state == "up"):
            assert time.monotonic() < deadline, said
            sup.tick()
            time.sleep(0.1)
        assert not any(alive(p) for p in seen), "a process of the dead node is left"
        assert len(tp_workers(proc.pid)) == 1
        seen |= {proc.pid, *descendants(proc.pid)}
        r = complete(url, prompt, 8)
        assert r.status_code == 200 and token_ids(r) == ref
    finally:
        sup.stop_all()
    deadline = time.monotonic() + 30
    while any(alive(p) for p in seen):
        assert time.monotonic() < deadline, [p for p in seen if alive(p)]
        time.sleep(0.1)
