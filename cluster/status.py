"""`pdserve status`: one screen about a running cluster, read from its Redis.

Finds Redis from `--redis-url`, or from the newest run directory's cluster.json (an
embedded Redis listens on a port picked at launch). Shows the launcher's view (every
process, its state, pid and restarts), a live `/health` probe of each, and the nodes'
registry records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

from pdserve.cluster.registry import OPEN, RecordCheck
from pdserve.common.cluster_secret import load_cluster_secret
from pdserve.common.redis_auth import (
    PASSWORD_ENV,
    embedded_password,
    redact,
    url_password,
    with_password,
)
from pdserve.common.redis_keys import ClusterKeys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pdserve status`: show a running cluster (processes, health, registry) from Redis."""
    p.add_argument("config", nargs="?", default=None, help="the cluster's YAML file")
    p.add_argument("--redis-url", default=None, help="the cluster's Redis (default: run dir)")
    p.add_argument("--cluster", default=None, help="cluster name (Redis key prefix)")
    p.add_argument("--run-dir", default="runs", help="where to look for cluster.json")
    p.add_argument("--json", action="store_true", help="print the launcher state as JSON")


def find_state_file(run_root: Path, cluster: str | None) -> Path | None:
    pattern = f"{cluster}-latest" if cluster else "*-latest"
    files = [p / "cluster.json" for p in run_root.glob(pattern) if (p / "cluster.json").exists()]
    return max(files, key=lambda f: f.stat().st_mtime, default=None)


def read_status(
    redis_url: str, cluster: str, check: RecordCheck = OPEN
) -> tuple[dict | None, list[dict]]:
    """The launcher's state and the registry's node records, from Redis; a record that
    `check` refuses (unsigned, forged) carries why under "ignored", as readers ignore it."""
    import redis

    keys = ClusterKeys(cluster)
    url = with_password(redis_url)
    with redis.Redis.from_url(url, socket_timeout=2.0, decode_responses=True) as r:
        raw = r.get(keys.launcher)
        nodes = []
        for key in sorted(r.scan_iter(keys.node_pattern)):
            if r.type(key) == "hash":
                fields = r.hgetall(key)
                why = check.refusal(key.rsplit(":", 1)[1].encode(), fields)
                nodes.append({"key": key, **fields, **({"ignored": why} if why else {})})
    return (json.loads(raw) if raw else None), nodes


def probe(url: str) -> str:
    if not url.startswith("http"):
        return "-"
    try:
        return str(httpx.get(f"{url}/health", timeout=2.0).status_code)
    except httpx.HTTPError as e:
        return type(e).__name__


def render(state: dict | None, nodes: list[dict]) -> str:
    lines = []
    if state:
        lines.append(
            f"cluster '{state['cluster']}' ({state['launcher']} launcher, pid "
            f"{state['launcher_pid']}), run dir {state['run_dir']}"
        )
        lines.append(f"  {'service':<12} {'state':<9} {'pid':>8} {'restarts':>8} health  url")
        for s in state["services"]:
            lines.append(
                f"  {s['name']:<12} {s['state']:<9} {s['pid'] or '-':>8} {s['restarts']:>8} "
                f"{probe(s['url']):<7} {s['url']}"
            )
        if state.get("router_url"):
            lines.append(f"OpenAI API: {state['router_url']}/v1")
    lines.append(f"registry: {len(nodes)} live node record(s)")
    if nodes:
        lines.append(f"  {'node':<12} {'role':<8} {'epoch':>14} {'run':>4} {'wait':>4} "
                     f"{'kv blocks':>11} {'remote':>6} {'age':>5}  url")  # fmt: skip
    for n in nodes:
        try:
            age = f"{time.time() - float(n.get('updated', 'nan')):.1f}s"
        except ValueError:
            age = "?"
        kv = f"{n.get('kv_used', '?')}/{n.get('kv_total', '?')}"
        lines.append(
            f"  {n['key'].rsplit(':', 1)[1]:<12} {n.get('role', '?'):<8} "
            f"{n.get('epoch', '?'):>14} {n.get('running', '?'):>4} {n.get('waiting', '?'):>4} "
            f"{kv:>11} {remote_share(n):>6} {age:>5}  {n.get('url', '')}"
            + (f"  IGNORED: {n['ignored']}" if "ignored" in n else "")
        )
    return "\n".join(lines)


def remote_share(n: dict) -> str:
    """The share of a node's requests prefilled by a prefill node ("-": none yet)."""
    try:
        remote, local = int(n.get("prefills_remote", 0)), int(n.get("prefills_local", 0))
    except ValueError:
        return "?"
    return f"{100 * remote / (remote + local):.0f}%" if remote + local else "-"


def run(args: argparse.Namespace) -> None:
    cluster, redis_url = args.cluster, args.redis_url
    run_root = Path(args.run_dir)
    secret_file, embedded = None, False
    if args.config:
        from pdserve.cluster.config_file import ConfigFileError, load_config

        try:
            cfg = load_config(args.config)
        except ConfigFileError as e:
            raise SystemExit(f"pdserve status: {e}") from None
        cluster = cluster or cfg.cluster
        run_root = Path(cfg.launcher.run_dir)
        secret_file, embedded = cfg.secret_file, cfg.redis.embedded
        if redis_url is None and not cfg.redis.embedded:
            redis_url = cfg.redis.url
    if redis_url is None:
        state_file = find_state_file(run_root, cluster)
        if state_file is None:
            raise SystemExit(f"pdserve status: no cluster.json under {run_root}; --redis-url?")
        saved = json.loads(state_file.read_text())
        redis_url, cluster = saved["redis_url"], cluster or saved["cluster"]
        embedded = saved.get("redis_embedded", False)
    cluster = cluster or "pdserve"
    try:
        secret = load_cluster_secret(secret_file)
    except ValueError as e:
        raise SystemExit(f"pdserve status: {e}") from None
    if secret and embedded:  # the launcher's embedded server wants the derived password
        redis_url = with_password(
            redis_url, os.environ.get(PASSWORD_ENV) or embedded_password(secret)
        )
    try:
        state, nodes = read_status(redis_url, cluster, RecordCheck(secret))
    except Exception as e:
        msg = str(e).replace(url_password(redis_url) or "\0", "***")
        if "auth" in msg.lower():
            msg += " (a cluster with a secret: give its config, PDSERVE_CLUSTER_SECRET_FILE "
            msg += f"or {PASSWORD_ENV})"
        raise SystemExit(f"pdserve status: cannot read {redact(redis_url)}: {msg}") from None
    if state is None and not nodes:
        raise SystemExit(f"pdserve status: no cluster '{cluster}' in {redact(redis_url)}")
    if args.json:
        json.dump({"launcher": state, "nodes": nodes}, sys.stdout, indent=2)
        print()
    else:
        print(render(state, nodes))
