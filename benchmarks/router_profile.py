"""Where the router's time goes, per request and phase (wall time inside the router process).

The router runs as usual (`pdserve router`, Redis registry, `kv_aware`) in front of one
fake decode node (benchmarks/fake_fleet.py), with timing wrappers around its phases; one
request at a time, so each phase's time is that request's. Reported per phase: calls per
request and the median and mean microseconds per request, plus the router process's CPU
time per request (from /proc/<pid>/task/*/schedstat, ns: includes what no wrapper sees, e.g. uvicorn's HTTP parsing
and the event loop). Round trips (`redis_lookup`, `node_*`) are waits, not router CPU.

    python benchmarks/router_profile.py --requests 1000 --out results/router_profile.json
"""

from __future__ import annotations

import argparse
import atexit
import functools
import inspect
import json
import os
import random
import signal
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx

# run as a script: benchmarks/ is not installed, the repository root holds it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# phase -> (module, attribute path): each is wrapped in the router process
PHASES = {
    "total_in_app": ("pdserve.router.app", "RouterApp.__call__"),
    "read_body": ("pdserve.router.fast_path", "_read_body"),
    "parse_validate": ("pdserve.router.fast_path", "parse"),
    "tokenize_and_model_check": ("pdserve.router.serving", "RouterServing.completion_prompts"),
    "chat_template_tokenize": ("pdserve.router.serving", "RouterServing.chat_tokens"),
    "prompt_checks": ("pdserve.router.serving", "RouterServing.check_prompt"),
    "sampling_checks": ("pdserve.router.serving", "RouterServing.check_sampling"),
    "body_finite_check": ("pdserve.router.serving", "_check_finite"),
    "body_encode": ("pdserve.router.serving", "encode_body"),
    "decision_total": ("pdserve.router.selector", "Selector.select"),  # retries (and older code)
    # attempt 0: candidates + lookup sent, then (after the sampling checks) reply + policies
    "decision_begin": ("pdserve.router.selector", "Selector.begin"),
    "decision_finish": ("pdserve.router.selector", "Selector.finish"),
    "hash_chain": ("pdserve.router.selector", "hash_prompt_blocks"),
    "redis_lookup_round_trip": ("pdserve.cluster.kv_index", "PrefixHits.__call__"),  # older code
    # the wait that is left once the sampling checks and the body ran meanwhile
    "redis_lookup_wait_after_checks": ("pdserve.cluster.kv_index", "PendingHits.result"),
    "policy_kv_aware": ("pdserve.router.policies", "KVAware.__call__"),
    "policy_round_robin": ("pdserve.router.policies", "RoundRobin.__call__"),
    "metrics_decision": ("pdserve.router.serving", "RouterServing._observe_decision"),
    "metrics_count": ("pdserve.router.serving", "RouterServing.count"),
    "node_json_round_trip": ("pdserve.router.serving", "send_json"),
    "node_stream_to_first_token": ("pdserve.router.serving", "open_stream"),
    # StreamingResponse subclasses have their own __call__: this times JSON answers only
    "response_write_json": ("starlette.responses", "Response.__call__"),
    "response_stream_relay": (
        "pdserve.api.http",
        "AbortOnDisconnectResponse.__call__",
    ),  # older code
    "response_stream_relay_watched": ("pdserve.router.streamed", "RelayResponse.__call__"),
}


def _wrap(fn, record):
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                record(time.perf_counter() - t0)

    else:

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                record(time.perf_counter() - t0)

    return timed


def child(out: str, router_args: list[str]) -> None:
    """The router process: wrap the phases, serve, write the timings at exit."""
    import importlib

    times: dict[str, list[float]] = defaultdict(list)
    for phase, (mod, path) in PHASES.items():
        try:
            owner = importlib.import_module(mod)
        except ImportError:  # older router code (--router-root): not timed
            continue
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        if not hasattr(owner, name):  # older router code (--router-root): not timed
            continue
        raw = vars(owner).get(name) if isinstance(owner, type) else None
        timed = _wrap(getattr(owner, name), times[phase].append)
        setattr(owner, name, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
    atexit.register(lambda: Path(out).write_text(json.dumps(times)))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    from pdserve.cli import main

    sys.argv = ["pdserve", "router", *router_args]
    main()


def summarize(times: dict[str, list[float]], n: int, skip: int) -> dict:
    out = {}
    for phase in PHASES:
        xs = times.get(phase, [])
        if not xs:
            continue
        per_call = xs[skip * len(xs) // (n + skip) :]  # warm-up excluded
        out[phase] = {
            "calls_per_request": round(len(xs) / (n + skip), 2),
            "p50_us": round(statistics.median(per_call) * 1e6, 1),
            "mean_us": round(statistics.fmean(per_call) * 1e6, 1),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--log-level", default="warning")
    ap.add_argument(
        "--router-root", default=None, metavar="DIR",
        help="run the router from this checkout (phases it lacks are not timed)",
    )  # fmt: skip
    ap.add_argument("--out", default="results/router_profile.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args.child:
        child(args.child, rest)
        return
    from benchmarks.router_fleet import (
        ROOT,
        free_port,
        spawn,
        usable_nodes,
        wait_until,
    )
    from benchmarks.router_fleet import write_tokenizerless_model as fake_model
    from benchmarks.router_overhead import cpu_ns, one, wait_for_fake_node
    from pdserve.cluster.embedded_redis import EmbeddedRedis

    root = Path(args.router_root).resolve() if args.router_root else ROOT
    results: dict = {"router_code": str(root)}
    with EmbeddedRedis() as redis:
        fleet = spawn(["-m", "benchmarks.fake_fleet", "--redis-url", redis.url,
                       "--prefill", "0", "--decode", "1"])  # fmt: skip
        procs = [fleet]
        try:
            wait_for_fake_node(redis.url)
            for stream in (False, True):
                times_path = f"/tmp/pdserve-router-profile-{os.getpid()}.json"
                port = free_port()
                router = f"http://127.0.0.1:{port}"
                proc = spawn([__file__, "--child", times_path,
                              "--port", str(port), "--log-level", args.log_level,
                              "--drain-timeout-s", "0", "--model", str(fake_model()),
                              "--served-model-name", "fake", "--redis-url", redis.url],
                             root)  # fmt: skip
                procs.append(proc)
                wait_until("router", lambda u=router: usable_nodes(u) == 1)
                rng = random.Random(0)
                skip = 50
                with httpx.Client(timeout=30) as c:
                    for i in range(args.requests + skip):
                        if i == skip:
                            cpu0 = cpu_ns(proc.pid)
                        body = {"prompt": [rng.randrange(1000) for _ in range(args.prompt_tokens)],
                                "max_tokens": 2, "temperature": 0, "stream": stream}  # fmt: skip
                        one(c, router, body)
                cpu = (cpu_ns(proc.pid) - cpu0) / 1e9
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
                times = json.loads(Path(times_path).read_text())
                Path(times_path).unlink()
                results["sse" if stream else "json"] = {
                    "router_cpu_per_request_us": round(cpu / args.requests * 1e6, 1),
                    "phases": summarize(times, args.requests, skip),
                }
        finally:
            for p in procs:
                p.kill()
                p.wait()
    results.update(requests=args.requests, prompt_tokens=args.prompt_tokens,
                   log_level=args.log_level, load_average=os.getloadavg())  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
