"""`pdserve restart NAME...`: a rolling restart of a launched cluster's nodes, one at a time.

NAME is a node (`decode-0`) or a group (`decode`: every `decode-<i>`). The launcher's state
comes from the newest cluster.json under `--run-dir` (or the `--cluster` one). Each node in
turn gets SIGTERM, and drains: no new requests, and every stream that
came through the router is handed back to it, which moves the stream to another decode
node (router/migration.py); the launcher's supervisor then starts it again. The next node
is restarted only once this one is back: healthy in the launcher's view with a new pid and,
where the router answers `/cluster`, registered there again with a new epoch, healthy and
with its breaker closed, so that a group always keeps a node to take the streams. A node
that is not back within `--timeout-s` stops the restart with an error (the others are left
as they are); one still starting when its turn comes is waited for first. The only node of
its kind is refused (nothing would take its streams) unless `--force`. Each restart is one
of the supervisor's restarts (`launcher.restart`): with restarts off, or at
`max_restarts`, the node stays down, and the command says so. Local launcher only: a Ray-launched node's pid belongs to another host.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

import httpx

from pdserve.cluster.status import find_state_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`pdserve restart`: restart nodes one at a time, their streams moved, nothing dropped."""
    p.add_argument("names", nargs="+", help="nodes (decode-0) or groups (decode, prefill)")
    p.add_argument("--run-dir", default="runs", help="where the launcher's cluster.json is")
    p.add_argument("--cluster", default=None, help="cluster name (default: the newest run)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per node, to be back")
    p.add_argument(
        "--force",
        action="store_true",
        help="restart a node that is the only one of its kind (its streams and requests fail)",
    )


def chosen(services: list[dict], names: list[str]) -> list[dict]:
    """The node services NAME picks, in the cluster.json's order; SystemExit naming what
    matches nothing."""
    nodes = [s for s in services if s.get("kind") in ("prefill", "decode", "colocated")]
    out: list[dict] = []
    for name in names:
        hit = [s for s in nodes if s["name"] == name or s["name"].rsplit("-", 1)[0] == name]
        if not hit:
            known = ", ".join(s["name"] for s in nodes) or "none"
            raise SystemExit(f"pdserve restart: no node or group {name!r} (nodes: {known})")
        out += [s for s in hit if s not in out]
    return out


class Watch:
    """The launcher's state file, and the router's view of the nodes."""

    def __init__(self, state_file: Path):
        self.state_file = state_file

    def state(self) -> dict:
        return json.loads(self.state_file.read_text())

    def service(self, name: str) -> dict:
        return next(s for s in self.state()["services"] if s["name"] == name)

    def router_view(self, url: str) -> dict | None:
        """The router's summary of the node at `url`; None if the router does not answer
        (`{}`: it answers and does not list the node)."""
        router = self.state().get("router_url")
        if not router:
            return None
        try:
            r = httpx.get(f"{router}/cluster", timeout=5)
            if r.status_code != 200:
                return None
            return next((n for n in r.json()["nodes"] if n["url"] == url), {})
        except (httpx.HTTPError, ValueError, KeyError):
            return None


def wait_serving(watch: Watch, name: str, timeout_s: float, say) -> dict:
    """The node's service once it is up in the launcher's view and, where the router
    answers, healthy there with its breaker closed (a node still starting is waited for)."""
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        svc = watch.service(name)
        if svc["state"] == "failed":
            raise SystemExit(f"pdserve restart: {name} has failed; see {svc['log']}")
        if svc["state"] == "up" and svc["pid"]:
            seen = watch.router_view(svc["url"])
            if seen is None or (seen.get("healthy") and seen.get("breaker") == "closed"):
                return svc
        if time.monotonic() > deadline:
            raise SystemExit(f"pdserve restart: {name} not serving after {timeout_s:g} s")
        if not said:
            say(f"[restart] {name}: waiting for it to serve first ({svc['state']})")
            said = True
        time.sleep(0.2)


def restart_one(watch: Watch, name: str, timeout_s: float, say) -> float:
    """SIGTERM one node and wait until it serves again; its seconds."""
    svc = wait_serving(watch, name, timeout_s, say)
    old_pid = svc["pid"]
    before = watch.router_view(svc["url"]) or {}
    t0 = time.monotonic()
    say(f"[restart] {name}: SIGTERM to pid {old_pid} (draining)")
    try:
        os.kill(old_pid, signal.SIGTERM)  # the node drains, then stops what it started
    except ProcessLookupError:
        pass  # it exited on its own just now: the supervisor brings it back all the same
    deadline = t0 + timeout_s
    stage = "exit"
    while True:
        now = watch.service(name)
        if stage == "exit" and (now["pid"] != old_pid or now["state"] != "up"):
            say(f"[restart] {name}: exited after {time.monotonic() - t0:.1f} s")
            stage = "up"
        if stage == "up" and now["state"] == "up" and now["pid"] != old_pid:
            stage = "router"
        if stage == "router":
            seen = watch.router_view(svc["url"])
            if seen is None or (
                seen
                and seen.get("epoch") != before.get("epoch")
                and seen.get("healthy")
                and seen.get("breaker") == "closed"
            ):
                took = time.monotonic() - t0
                say(f"[restart] {name}: serving again (pid {now['pid']}) after {took:.1f} s")
                return took
        if now["state"] == "failed":
            raise SystemExit(f"pdserve restart: {name} failed to start again; see {now['log']}")
        if time.monotonic() > deadline:
            raise SystemExit(f"pdserve restart: {name} not back after {timeout_s:g} s ({stage})")
        time.sleep(0.2)


def run(args: argparse.Namespace) -> None:
    state_file = find_state_file(Path(args.run_dir), args.cluster)
    if state_file is None:
        raise SystemExit(f"pdserve restart: no cluster.json under {args.run_dir}")
    watch = Watch(state_file)
    state = watch.state()
    if state.get("launcher") != "local":
        raise SystemExit(
            f"pdserve restart: the {state.get('launcher')} launcher's nodes run on other "
            "hosts; only a local launcher's cluster can be restarted from here"
        )
    targets = chosen(state["services"], args.names)
    t0 = time.monotonic()
    for svc in targets:
        peers = [
            s for s in state["services"] if s["kind"] == svc["kind"] and s["name"] != svc["name"]
        ]
        if not peers and not args.force:
            raise SystemExit(
                f"pdserve restart: {svc['name']} is the only {svc['kind']} node: nothing "
                "would take its streams (--force restarts it anyway)"
            )
        # the others of its kind serve first: they take its streams and its requests
        for other in state["services"]:
            if other["kind"] == svc["kind"] and other["name"] != svc["name"]:
                wait_serving(watch, other["name"], args.timeout_s, print)
        restart_one(watch, svc["name"], args.timeout_s, print)
    print(f"[restart] {len(targets)} node(s) restarted in {time.monotonic() - t0:.1f} s")
