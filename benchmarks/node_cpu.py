"""CPU seconds per output token of one node's processes under `pdserve bench serve`.

Starts a node (`python -m pdserve serve`, the given flags), warms it up with a few
requests, then runs `pdserve bench serve` (random dataset, streaming, rate inf) against it
`--rounds` times, each with new prompts (none in the prefix cache). Around each run it reads user + system CPU seconds from /proc (Linux) of
the node's API process, of its engine process (and of each engine thread: the main thread
runs the step, the OpenMP workers only the forward, the I/O threads encode and send) and of
the benchmark client (its whole process, start-up included). CPU seconds per output token
do not depend on how long other processes kept a core, so two trees can be compared on a
loaded box: what a node spends beyond its model forward is its API process plus the
engine's Python, per token.

`--ab-tree DIR` also starts a node from another checkout (its code, run from DIR) and
alternates the rounds between the two nodes, so both see the same box; the report gives
each side's median and the ratio. With a tiny model (a random 2-layer Llama with the real
tokenizer) the engine is cheap and the API process's share is as large as it gets.

    python benchmarks/node_cpu.py --rounds 3 --out results/node_cpu.json -- --num-threads 2
    python benchmarks/node_cpu.py --model DIR --output-len 512 --rounds 6 \\
        --ab-tree /tmp/base --out results/node_cpu_ab.json -- --num-threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.http_vs_offline import cpu_seconds, engine_pid, free_port, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")
KEYS = ("api_ms_per_token", "engine_ms_per_token", "client_ms_per_token")


def user_sys(path: Path) -> tuple[float, float]:
    """User and system CPU seconds from a /proc stat file."""
    fields = path.read_text().rpartition(")")[2].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread of `pid`, keyed "tid:name"."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            out[f"{task.name}:{name}"] = sum(user_sys(task / "stat"))
        except OSError:
            pass  # the thread ended
    return out


class Node:
    """One `pdserve serve` process started from `tree` (its code and working directory)."""

    def __init__(self, tree: Path, args) -> None:
        self.tree = tree
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rpartition(":")[2]
        cmd = [sys.executable, "-m", "pdserve", "serve", "--model", args.model, "--port", port]
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.proc = subprocess.Popen(
            cmd + args.serve_args, cwd=tree, env=env, stderr=subprocess.DEVNULL
        )
        self.pids: tuple[int, int] | None = None

    def wait_ready(self) -> None:
        wait_healthy(self.url, self.proc)
        self.pids = (self.proc.pid, engine_pid(self.proc.pid))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def bench_cmd(url: str, args, num_prompts: int, out: Path, seed: int) -> list[str]:
    """`seed`: the random prompts' (a new one each round: no round hits the prefix cache)."""
    return [
        sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", url,
        "--tokenizer", args.tokenizer or args.model, "--dataset", "random",
        "--input-len", str(args.input_len), "--output-len", str(args.output_len),
        "--num-prompts", str(num_prompts), "--request-rate", "inf", "--no-progress",
        "--no-plots", "--out", str(out), "--log-level", "warning", "--seed", str(seed),
    ]  # fmt: skip


def run_bench(cmd: list[str]) -> float:
    """Run the client (this tree's); its CPU seconds (from wait4's rusage)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    _, status, ru = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"bench serve exited with {os.waitstatus_to_exitcode(status)}")
    return ru.ru_utime + ru.ru_stime


def one_round(node: Node, args, out: Path, seed: int) -> dict:
    api, eng = node.pids
    api_us0, eng0, th0 = user_sys(Path(f"/proc/{api}/stat")), cpu_seconds(eng), thread_cpu(eng)
    t = time.perf_counter()
    client = run_bench(bench_cmd(node.url, args, args.num_prompts, out, seed))
    wall = time.perf_counter() - t
    api_us1, eng1, th1 = user_sys(Path(f"/proc/{api}/stat")), cpu_seconds(eng), thread_cpu(eng)
    run = json.loads(out.read_text())["runs"][0]["metrics"]
    if run["failed"]:
        raise RuntimeError(f"{run['failed']} requests failed: {run['failure_reasons']}")
    ms = 1000 / run["total_output_tokens"]
    threads = {k: round((th1[k] - v) * ms, 4) for k, v in th0.items() if k in th1}
    api_user, api_sys = ((b - a) * ms for a, b in zip(api_us0, api_us1))
    return {
        "output_tokens": run["total_output_tokens"],
        "wall_s": wall,
        "output_tok_s": run["output_throughput"],
        "api_ms_per_token": api_user + api_sys,
        "api_user_ms_per_token": api_user,
        "api_sys_ms_per_token": api_sys,
        "engine_ms_per_token": (eng1 - eng0) * ms,
        "client_ms_per_token": client * ms,
        "engine_threads_ms_per_token": {k: v for k, v in threads.items() if v > 0},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokenizer", default=None, help="for the client (default: --model)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ab-tree", default=None, help="another checkout: alternate with its node")
    p.add_argument("--out", default=str(ROOT / "results" / "node_cpu.json"))
    p.add_argument("serve_args", nargs="*", help="after --: more `pdserve serve` flags")
    args = p.parse_args()
    trees = {"this": ROOT}
    if args.ab_tree:
        trees["ab"] = Path(args.ab_tree).resolve()
    tmp = Path(args.out).with_suffix(".d")
    tmp.mkdir(parents=True, exist_ok=True)
    nodes = {name: Node(tree, args) for name, tree in trees.items()}
    rounds: dict[str, list[dict]] = {name: [] for name in nodes}
    try:
        for name, node in nodes.items():
            node.wait_ready()
            run_bench(bench_cmd(node.url, args, 4, tmp / f"warmup_{name}.json", seed=0))
        for i in range(args.rounds):
            for name, node in nodes.items():
                r = one_round(node, args, tmp / f"bench_{name}_{i}.json", seed=i + 1)
                rounds[name].append(r)
                print(
                    f"round {i} {name}: {r['output_tok_s']:.1f} tok/s, CPU ms/token: API "
                    f"{r['api_ms_per_token']:.4f} (user {r['api_user_ms_per_token']:.4f}), "
                    f"engine {r['engine_ms_per_token']:.4f}, client "
                    f"{r['client_ms_per_token']:.4f}; engine threads "
                    f"{r['engine_threads_ms_per_token']}",
                    flush=True,
                )
    finally:
        for node in nodes.values():
            node.stop()
    result = {"config": vars(args), "trees": {k: str(v) for k, v in trees.items()}}
    for name, rs in rounds.items():
        med = {k: statistics.median(r[k] for r in rs) for k in KEYS}
        result[name] = {"rounds": rs, "median": med}
        print(f"{name} median CPU ms/token:", {k: round(v, 4) for k, v in med.items()})
    if "ab" in rounds:
        per_round = [a["api_ms_per_token"] / b["api_ms_per_token"] for a, b in
                     zip(rounds["this"], rounds["ab"])]  # fmt: skip
        result["api_this_over_ab"] = statistics.median(per_round)
        print(f"API CPU per token, this / ab: median of rounds {result['api_this_over_ab']:.3f}")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
