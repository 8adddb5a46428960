"""The gap a streaming client sees when its decode node dies mid-stream and the router moves
the stream (router/migration.py), by where the continuation's KV comes from.

    python benchmarks/migration_gap.py                 # 3 runs per path
    python benchmarks/migration_gap.py --quick         # smoke: 1 short run per path
    python benchmarks/migration_gap.py --paths prefill_node,prefix_cache --runs 5

Real clusters from `pdserve launch` (tests/faults/harness.py `Cluster`: embedded Redis, the
router with round_robin decode policy, 2 decode nodes, the real SmolLM2-135M). One greedy
completion (a fresh random ~1000-token prompt per run, max_tokens 200, ignore_eos) is
streamed; after `--kill-after` content chunks its decode node's process group gets SIGKILL
and the router continues the stream on the other decode node. The gap: the longest pause
between two content chunks from the last one before the kill on (the client's clock); also
reported: the router's own `pdserve_router_migration_gap_seconds` for the run, kill to first
chunk after, the stream's TTFT and inter-token interval before the kill, and the path the
router logged ("migrated ... via <path>"). Paths (the cluster each needs):

  prefill_node  1 prefill + 2 decode nodes (NIXL): the prefill node computes the tokens it
                lacks (it holds the prompt) and ships prompt + generated KV to the new node;
  prefix_cache  the same cluster; the identical request ran first on the other decode node,
                so its prefix cache holds prompt + generated (the router then prefills locally);
  store         no prefill node, `kv_store: lmcache` on the cluster's Redis: the new node loads
                the stored prompt chunks and computes the rest (the store holds whole
                `chunk_size` chunks of prompts; generated tokens are never saved);
  local         no prefill node, no store: the new node computes prompt + generated itself.

Between runs the launcher restarts the killed node; the run waits for the router to use it
again and warms it with one request. Writes results/migration_gap.json and a bar chart
(.png, if matplotlib is installed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.faults.harness import Cluster  # noqa: E402
from tests.servers import free_ports  # noqa: E402

MODEL = "smollm2-135m-instruct"
DECODES = ("decode-0", "decode-1")
PATHS = ("prefill_node", "prefix_cache", "store", "local")
CLUSTER_OF = {"prefill_node": "pd", "prefix_cache": "pd", "store": "store", "local": "local"}

try:
    from tqdm import tqdm
except ImportError:  # a plain counter instead
    tqdm = None


def say(msg: str) -> None:
    (tqdm.write if tqdm else print)(msg)


def cluster_extra(kind: str, args) -> dict:
    """The harness config overrides for one cluster kind (pd, local, store)."""
    p = free_ports(4)
    decode = {"count": 2, "port": p[2:], "num_blocks": args.num_blocks}
    extra: dict = {
        "model": {"name": MODEL, "block_size": 16},
        "router": {"decode_policy": "round_robin", "max_retries": 1},
        "decode": decode,
    }
    if kind == "pd":
        # the product's step budget (the harness's 256 suits its tiny model)
        extra["prefill"] = {"count": 1, "port": p[:1], "kv_port": p[1:2],
                            "num_blocks": args.num_blocks, "max_num_batched_tokens": 2048}  # fmt: skip
        if args.local_prefill_max_tokens is not None:
            decode["local_prefill_max_tokens"] = args.local_prefill_max_tokens
    else:  # no prefill node: decode nodes prefill locally, no transfer connector
        extra["prefill"] = None
        decode["connector"] = None
    if args.restart_backoff_s is not None:  # the killed node's restart after the gap
        b = args.restart_backoff_s
        extra["launcher"] = {"restart": {"backoff_s": b, "backoff_max_s": b, "max_restarts": 20}}
    if kind == "store":
        extra["kv_store"] = {"backend": "lmcache", "chunk_size": args.store_chunk_size}
    return extra


def service(c: Cluster, name: str) -> dict:
    """`c.service`, across a moment when cluster.json is being rewritten."""
    for _ in range(100):
        found = [s for s in c.state()["services"] if s["name"] == name]
        if found:
            return found[0]
        time.sleep(0.1)
    raise RuntimeError(f"{name} is not in cluster.json")


def url(c: Cluster, path: str) -> str:
    return service(c, "router")["url"] + path


def scrape(c: Cluster) -> dict[str, float]:
    out = {}
    for line in httpx.get(url(c, "/metrics"), timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def selections(c: Cluster) -> dict[str, float]:
    m = scrape(c)
    out = {}
    for name in DECODES:
        key = f'pdserve_router_selections_total{{node="{service(c, name)["url"]}",role="decode"}}'
        out[name] = sum(v for k, v in m.items() if k.startswith(key))
    return out


def by_path(m: dict[str, float], metric: str) -> dict[str, float]:
    pat = re.compile(metric + r'\{path="(\w+)"\}')
    return {g.group(1): v for k, v in m.items() if (g := pat.fullmatch(k))}


def delta(m0: dict[str, float], m1: dict[str, float], metric: str) -> dict[str, float]:
    """Per path, how much `metric` grew from scrape m0 to m1 (paths that grew)."""
    a, b = by_path(m0, metric), by_path(m1, metric)
    return {p: v - a.get(p, 0) for p, v in b.items() if v > a.get(p, 0)}


def body_of(prompt: list[int], max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip


def stream(c: Cluster, body: dict, rid: str, kill_after: int | None = None) -> dict:
    """Read one stream to its end; with `kill_after`, SIGKILL its decode node's process
    group once that many content chunks came. Times are time.monotonic()."""
    before = selections(c)
    out: dict = {"rid": rid, "node": None, "times": [], "text": "", "finish": None,
                 "usage": None, "error": None, "done": False, "kill_index": None}  # fmt: skip
    t0 = out["t0"] = time.monotonic()
    headers = {"X-Request-Id": rid}
    with httpx.stream("POST", url(c, "/v1/completions"), json=body, headers=headers,
                      timeout=httpx.Timeout(300, connect=10)) as r:  # fmt: skip
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"].get("message")
                continue
            out["usage"] = chunk.get("usage") or out["usage"]
            for ch in chunk.get("choices") or []:
                out["times"].append(time.monotonic())
                out["text"] += ch.get("text") or ""
                out["finish"] = ch.get("finish_reason") or out["finish"]
            if out["node"] is None and out["times"]:
                after = selections(c)  # dispatched before its first token: counted
                got = [n for n in DECODES if after[n] > before[n]]
                out["node"] = got[0] if len(got) == 1 else None
            n = len(out["times"])
            if kill_after is not None and out["kill_index"] is None and n >= kill_after:
                assert out["node"] is not None, "could not tell which decode node serves it"
                out["victim_pid"] = service(c, out["node"])["pid"]
                os.killpg(out["victim_pid"], signal.SIGKILL)
                out["t_kill"], out["kill_index"] = time.monotonic(), n
    times = out["times"]
    out["ttft_s"] = times[0] - t0 if times else None
    k = out["kill_index"] or len(times)
    itl = [b - a for a, b in zip(times[1:k], times[2:k])]
    out["itl_before_s"] = statistics.median(itl) if itl else None
    out["total_s"] = times[-1] - t0 if times else None
    return out


def recover(c: Cluster, victim: str, old_pid: int, names: set[str], warm: dict) -> float:
    """Seconds until the launcher restarted `victim`, the router uses it and it served
    one warm-up request."""
    t0 = time.monotonic()
    deadline = t0 + 600
    while (v := service(c, victim))["pid"] == old_pid or v["state"] != "up":
        assert time.monotonic() < deadline, f"{victim} not restarted"
        time.sleep(0.5)
    settle(c, names, deadline)
    for _ in range(4):  # round robin: within two requests one lands on it
        s = stream(c, warm, f"mgap-warm-{os.urandom(4).hex()}")
        if s["node"] == victim:
            break
    return time.monotonic() - t0


def settle(c: Cluster, names: set[str], deadline: float) -> None:
    """Every process up, and the router using both decode nodes."""
    c.wait_up(600, names)
    while scrape(c).get('pdserve_router_usable_nodes{role="decode"}', 0) < 2:
        assert time.monotonic() < deadline, "the router does not use the restarted node"
        time.sleep(0.5)


def one_run(c: Cluster, path: str, i: int, args, rng: random.Random, names: set[str]) -> dict:
    prompt = [rng.randrange(1000, 48000) for _ in range(args.prompt_tokens)]
    body = body_of(prompt, args.max_tokens)
    run: dict = {"path": path, "run": i}
    ref = None
    if path == "prefix_cache":  # the identical request first, on the other decode node
        ref = stream(c, body, f"mgap-ref-{i}-{os.urandom(3).hex()}")
        run["reference"] = {"node": ref["node"], "ttft_s": ref["ttft_s"],
                            "itl_s": ref["itl_before_s"]}  # fmt: skip
    m0 = scrape(c)
    rid = f"mgap-{path.replace('_', '-')}-{i}-{os.urandom(3).hex()}"
    s = stream(c, body, rid, kill_after=args.kill_after)
    time.sleep(0.3)  # the router's log and histogram
    m1 = scrape(c)
    times, k = s["times"], s["kill_index"]
    run.update(rid=rid, victim=s["node"], ttft_s=s["ttft_s"], itl_before_s=s["itl_before_s"],
               chunks=len(times), kill_after_chunks=k, done=s["done"], error=s["error"],
               finish=s["finish"], usage=s["usage"])  # fmt: skip
    if ref is not None:
        run["placed_on_other_node"] = ref["node"] is not None and ref["node"] != s["node"]
        run["text_equals_reference"] = s["text"] == ref["text"]
    if k is not None and len(times) > k:
        # the old node's chunks still in flight come at once; the first pause longer than
        # 3 inter-token intervals is the migration (a later hiccup of the new node is not)
        gaps = [(times[j + 1] - times[j], j) for j in range(k - 1, len(times) - 1)]
        long = [g for g in gaps if g[0] > 3 * (s["itl_before_s"] or 0)]
        gap, j = long[0] if long else max(gaps)
        run.update(gap_s=gap, kill_to_resume_s=times[j + 1] - s["t_kill"],
                   chunks_after_kill_before_gap=j + 1 - k, max_pause_after_s=max(gaps)[0])  # fmt: skip
    # the path the router counted, as the new node reported it with its first token
    run["router_metric_path"] = list(delta(m0, m1, "pdserve_router_migrations_total"))
    run["router_gap_s"] = sum(delta(m0, m1, "pdserve_router_migration_gap_seconds_sum").values())
    if s["node"] is not None and "victim_pid" in s:
        warm = body_of([rng.randrange(1000, 48000) for _ in range(args.prompt_tokens)], 4)
        run["recover_s"] = recover(c, s["node"], s["victim_pid"], names, warm)
    return run


def box() -> dict:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((x.split(":", 1)[1].strip() for x in info if x.startswith("model name")), "?")
    flags = next((x for x in info if x.startswith("flags")), "").split()

    def git(*a: str) -> str:
        r = subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True)
        return r.stdout.strip()

    return {
        "cpu": cpu,
        "flags": {f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile")},
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "commit": git("rev-parse", "HEAD"),
        "worktree_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "load_average_start": os.getloadavg(),
    }


def median(xs):
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), 4) if xs else None


def summarize(runs: list[dict]) -> dict:
    return {
        "gap_s_median": median(r.get("gap_s") for r in runs),
        "gap_s_runs": [r.get("gap_s") for r in runs],
        "router_gap_s_runs": [r.get("router_gap_s") for r in runs],
        "kill_to_resume_s_runs": [r.get("kill_to_resume_s") for r in runs],
        "ttft_s_median": median(r.get("ttft_s") for r in runs),
        "itl_before_s_median": median(r.get("itl_before_s") for r in runs),
        "router_path_runs": [r.get("router_metric_path") for r in runs],
        "cached_tokens_runs": [
            ((r.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            for r in runs
        ],
        "complete_runs": sum(
            bool(r.get("done") and not r.get("error") and r.get("finish") == "length") for r in runs
        ),
    }


def plot(result: dict, png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = [p for p in PATHS if p in result["paths"] and result["paths"][p]["gap_s_median"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for x, p in enumerate(names):
        s = result["paths"][p]
        ax.bar(x, s["gap_s_median"], color="tab:blue", alpha=0.8)
        pts = [g for g in s["gap_s_runs"] if g is not None]
        ax.plot([x] * len(pts), pts, "k.", ms=6)
        ttft = result["clusters"][CLUSTER_OF[p]]["unfailed_ttft_s_median"]
        if ttft:
            ax.hlines(ttft, x - 0.4, x + 0.4, colors="tab:red", linestyles="--")
        logged = {v for r in s["router_path_runs"] for v in (r or ["?"])}
        ax.annotate(f"{s['gap_s_median']:.2f} s\nvia {','.join(sorted(logged))}",
                    (x, max(pts + [s["gap_s_median"]])), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 4), textcoords="offset points")  # fmt: skip
    ax.set_xticks(range(len(names)), names)
    ax.margins(y=0.15)
    ax.set_ylabel("client-seen gap across the migration (s)")
    w = result["workload"]
    ax.set_title(f"Migration gap by path ({w['prompt_tokens']}-token prompt, kill after "
                 f"{w['kill_after']} of {w['max_tokens']} tokens)\n"
                 f"{result['box']['cpu']}, {result['box']['nproc']} CPUs; dots: runs; red: "
                 "unfailed TTFT", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return True


def on_cluster(kind, info: dict, paths, args, rng, runs: dict, bar) -> None:
    """Launch one cluster, time unfailed requests on it, then the runs of its paths."""
    extra, work = info["config"], Path(tempfile.mkdtemp(prefix=f"mgap-{kind}-"))
    say(f"[{kind}] launching (logs: {work})")
    names = {"redis", "router", *DECODES} | ({"prefill-0"} if kind == "pd" else set())
    t0 = time.monotonic()
    c = Cluster(MODEL, work, extra)
    try:
        c.wait_up(600, names)
        info.update(logs=str(work), up_s=round(time.monotonic() - t0, 1), unfailed=[])
        for j in range(1 if args.quick else 2):  # warms both decode nodes, too
            prompt = [rng.randrange(1000, 48000) for _ in range(args.prompt_tokens)]
            s = stream(c, body_of(prompt, args.max_tokens), f"mgap-unfailed-{kind}-{j}")
            info["unfailed"].append({"node": s["node"], "ttft_s": s["ttft_s"],
                                     "itl_s": s["itl_before_s"], "total_s": s["total_s"]})  # fmt: skip
        info["unfailed_ttft_s_median"] = median(u["ttft_s"] for u in info["unfailed"])
        say(f"[{kind}] up in {info['up_s']} s; unfailed TTFT {info['unfailed_ttft_s_median']} s")
        for i in range(args.runs):
            for p in paths:  # interleaved: drift hits each path alike
                try:
                    r = one_run(c, p, i, args, rng, names)
                except (AssertionError, RuntimeError, httpx.HTTPError) as e:
                    r = {"path": p, "run": i, "failed": f"{type(e).__name__}: {e}"[:2000]}
                    time.sleep(3)  # a killed node: the launcher notices, restarts it
                    settle(c, names, time.monotonic() + 600)
                runs[p].append(r)
                say(f"[{p} #{i}] gap {r.get('gap_s')} s, router {r.get('router_gap_s')} s, "
                    f"counted via {r.get('router_metric_path')}, ttft {r.get('ttft_s')} s"
                    + (f", FAILED {r['failed']}" if "failed" in r else ""))  # fmt: skip
                if bar:
                    bar.update()
    finally:
        c.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--paths", default=",".join(PATHS), help="comma-separated, of " + str(PATHS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--kill-after", type=int, default=100, help="content chunks before the kill")
    ap.add_argument("--num-blocks", type=int, default=512, help="KV blocks per node")
    ap.add_argument("--store-chunk-size", type=int, default=256, help="kv_store.chunk_size")
    ap.add_argument("--local-prefill-max-tokens", type=int, help="pd: decode's (default: 16)")
    ap.add_argument("--restart-backoff-s", type=float,
                    help="launcher.restart.backoff_s (default 0.5: the restart overlaps the gap)")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="smoke: 1 run, 320/60/20 tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/migration_gap.json"))
    args = ap.parse_args()
    if args.quick:
        args.runs, args.prompt_tokens, args.max_tokens, args.kill_after = 1, 320, 60, 20
    paths = [p for p in args.paths.split(",") if p]
    assert set(paths) <= set(PATHS), f"unknown path in {paths}"
    rng = random.Random(args.seed)
    result: dict = {
        "box": box(),
        "model": MODEL,
        "workload": {**vars(args), "temperature": 0, "ignore_eos": True},
        "clusters": {},
        "paths": {},
    }
    bar = tqdm(total=len(paths) * args.runs, desc="migrations") if tqdm else None
    runs: dict[str, list[dict]] = {p: [] for p in paths}
    for kind in dict.fromkeys(CLUSTER_OF[p] for p in paths):
        info = result["clusters"][kind] = {"config": cluster_extra(kind, args)}
        try:
            on_cluster(
                kind, info, [p for p in paths if CLUSTER_OF[p] == kind], args, rng, runs, bar
            )
        except Exception as e:  # noqa: BLE001 - recorded; the other clusters still run
            info["failed"] = f"{type(e).__name__}: {e}"[:3000]
            say(f"[{kind}] FAILED: {info['failed']}")
    if bar:
        bar.close()
    for p in paths:
        result["paths"][p] = {"cluster": CLUSTER_OF[p], **summarize(runs[p]), "runs": runs[p]}
    result["load_average_end"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    png = out.with_suffix(".png")
    result_png = plot(result, png)
    print(json.dumps({p: {k: v for k, v in s.items() if k != "runs"}
                      for p, s in result["paths"].items()}, indent=2))  # fmt: skip
    print(f"wrote {out}" + (f" and {png}" if result_png else " (no matplotlib: no PNG)"))


if __name__ == "__main__":
    main()
