"""Startup time of a cluster config: `pdserve launch` to the first answered request.

Launches the config (default configs/local.yaml) with every port moved to a free one,
watches the run directory's cluster.json for when each stage is healthy, sends the
France question through the router until it is answered, then SIGTERMs the launcher
and times the drain. Writes JSON (results/launch_startup.json by default).

    .venv/bin/python benchmarks/launch_startup.py [--config FILE] [--runs N]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_overrides(config: Path) -> list[str]:
    sys.path.insert(0, str(ROOT))
    from pdserve.cluster.config_file import load_config

    cfg = load_config(config)
    sets = [f"router.port={free_port()}"]
    for role in ("prefill", "decode"):
        group = getattr(cfg, role)
        if group is None:
            continue
        sets.append(f"{role}.port=[{', '.join(str(free_port()) for _ in range(group.count))}]")
        if group.kv_port is not None:
            ports = ", ".join(str(free_port()) for _ in range(group.count))
            sets.append(f"{role}.kv_port=[{ports}]")
    return sets


def tree_cpu_s(root: int) -> float:
    """User + system CPU seconds used so far by `root` and its live descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0))[1]
        todo += [c for c, (ppid, _) in stats.items() if ppid == pid]
    return total / tick


def one_run(config: Path, timeout_s: float) -> dict:
    run_root = Path(tempfile.mkdtemp(prefix="pdserve-startup-"))
    sets = [*port_overrides(config), f"launcher.run_dir={run_root}", "launcher.log_level=warning"]
    cmd = [sys.executable, "-m", "pdserve", "launch", str(config)]
    for item in sets:
        cmd += ["--set", item]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    up: dict[str, float] = {}
    state: dict = {}
    answer, t_answer, cpu_s = None, None, 0.0
    try:
        while t_answer is None:
            if proc.poll() is not None:
                raise RuntimeError(f"launcher exited with {proc.returncode}; logs in {run_root}")
            if time.monotonic() - t0 > timeout_s:
                raise RuntimeError(f"no answer in {timeout_s} s; logs in {run_root}")
            files = list(run_root.glob("*-latest/cluster.json"))
            if files:
                state = json.loads(files[0].read_text())
                for s in state["services"]:
                    if s["state"] == "up" and s["name"] not in up:
                        up[s["name"]] = round(time.monotonic() - t0, 2)
            if state.get("router_url") and "router" in up:
                body = {"messages": QUESTION, "temperature": 0, "max_tokens": 20}
                try:
                    r = httpx.post(
                        f"{state['router_url']}/v1/chat/completions", json=body, timeout=60
                    )
                    if r.status_code == 200:
                        answer = r.json()["choices"][0]["message"]["content"]
                        t_answer = time.monotonic() - t0
                        cpu_s = tree_cpu_s(proc.pid)
                        break
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
    finally:
        t_stop = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        stop_s = time.monotonic() - t_stop
    return {
        "first_answer_s": round(t_answer, 2),
        "answer": answer,
        "healthy_at_s": up,
        # CPU time every process of the cluster used until then: on an otherwise idle box
        # with N cores, startup cannot be faster than cpu_s / N.
        "cpu_s_to_first_answer": round(cpu_s, 1),
        "stop_s": round(stop_s, 2),
        "launcher_exit_code": code,
        "load_average_1m_at_end": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "local.yaml"))
    p.add_argument("--runs", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=600)
    p.add_argument("--out", default=str(ROOT / "results" / "launch_startup.json"))
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    runs = [one_run(Path(args.config), args.timeout_s) for _ in range(args.runs)]
    result = {
        "config": args.config,
        "cpus": len(os.sched_getaffinity(0)),
        "runs": runs,
        "first_answer_s_min": min(r["first_answer_s"] for r in runs),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
