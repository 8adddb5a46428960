"""One seeded random run of the simulated PD cluster (`run_seed`): everything drawn from
the seed, so a failing seed reproduces exactly (`python -m tests.pd_sim.scenario SEED`)."""

from __future__ import annotations

import random
import sys

from tests.pd_sim.cluster import Clocks, Cluster
from tests.pd_sim.world import Faults


def run_seed(seed: int) -> Cluster:
    rng = random.Random(seed * 7919 + 1)
    faults = Faults(
        ctl_delay=rng.choice([0.0, 0.01, 0.05]),
        ctl_drop=rng.choice([0.0, 0.0, 0.02, 0.1]),
        write_delay=rng.choice([0.0, 0.02, 0.1, 0.4]),
        write_fail=rng.choice([0.0, 0.0, 0.05, 0.2]),
        step_time=rng.choice([0.0, 0.0, 0.05, 0.5]),
        # a slow link now and then (drawn apart, so the other draws stay as they were):
        # WRITEs outlive leases, so a fence must cancel them (kv_transfer/prefill_send.py)
        write_floor=random.Random(seed * 31 + 7).choice([0.0] * 9 + [2.5]),
        # a stopped or dead sender's data drains for longer than any grace now and then:
        # only the decode node's data fence keeps it out of reused blocks (decode_side)
        drain_s=random.Random(seed * 17 + 3).choice([0.1] * 3 + [5.0]),
    )
    num_prefill = rng.choice([1, 2])
    # every host's clock: any offset at all, and a rate error within the protocol's bound
    clocks = Clocks(
        [
            (rng.choice([0.0, rng.uniform(-1e6, 1e6), rng.uniform(-30, 30)]),
             1 + rng.choice([0.0, rng.uniform(-0.005, 0.005)]))
            for _ in range(num_prefill + 1)
        ]
    )  # fmt: skip
    c = Cluster(
        seed,
        faults,
        num_prefill=num_prefill,
        clocks=clocks,
        prefill_blocks=rng.choice([12, 24, 64]),
        prefill_budget=rng.choice([4, 8, 64]),
        decode_blocks=rng.choice([24, 64]),
        prefill_locally=rng.random() < 0.8,
    )
    if rng.random() < 0.2:  # a prefill node not reachable yet (orders queue locally)
        c.routers[c.addrs[0]].unreachable_until = c.world.now + rng.uniform(0, 1.5)
    shared = [rng.randrange(3, 500) for _ in range(rng.choice([0, 8, 16]))]
    plan = []  # (time offset, action, arg)
    for i in range(rng.randint(2, 7)):
        prompt = (shared if rng.random() < 0.5 else []) + [
            rng.randrange(3, 500) for _ in range(rng.randint(1, 40))
        ]
        at = rng.uniform(0, 0.6)
        plan.append((at, "submit", (f"r{i}", prompt, rng.randint(1, 4), rng.choice(c.addrs))))
        if rng.random() < 0.25:
            plan.append((at + rng.uniform(0, 0.5), "abort", f"r{i}"))
    if rng.random() < 0.15:  # the same request id again (a router retry)
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(9, 30))]
        plan.append((rng.uniform(0.6, 1.0), "retry", ("r0", prompt, 2, rng.choice(c.addrs))))
    for addr in c.addrs:
        if rng.random() < 0.15:
            plan.append((rng.uniform(0, 1.0), "kill", addr))
        if rng.random() < 0.2:
            plan.append((rng.uniform(0, 1.0), "stall", (addr, rng.uniform(0.1, 1.5))))
        if rng.random() < 0.2:  # a stuck (not dead) engine: its pump answers heartbeats
            plan.append((rng.uniform(0, 1.0), "hang", (addr, rng.uniform(0.1, 3.0))))
        for _ in range(rng.choice([0, 0, 1, 5])):  # reconnect churn
            plan.append((rng.uniform(0, 1.2), "reconnect", addr))
    plan.sort(key=lambda x: x[0])
    start = c.world.now
    for at, action, arg in plan:
        while c.world.now - start < at:
            c.step()
        if action == "submit" or (action == "retry" and c.reqs["r0"].finish is not None):
            rid, prompt, n, node = arg
            c.submit(rid, prompt, n, node)
        elif action == "abort" and c.reqs[arg].finish is None:
            c.abort(arg)
        elif action == "kill":
            c.kill(arg)
        elif action == "stall":
            c.stall(*arg)
        elif action == "hang":
            c.hang(*arg)
        elif action == "reconnect":
            c.reconnect(arg)
    c.run_until_idle()
    c.check_final()
    return c


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO)
    cl = run_seed(int(sys.argv[1]))
    print(cl.describe(), {r: (t.finish, t.error) for r, t in cl.reqs.items()})
