"""The PD protocol under a seeded simulator: real DecodeRole/PrefillRole, real schedulers,
KV cache managers and connector sides (`pdserve.kv_transfer.decode_side`/`prefill_side`, the real
`DecodeControl` liveness and queues) over an in-memory transport that delays, reorders
and drops control messages, delays and fails WRITEs, stalls and kills prefill nodes, and
aborts and retries requests at random points (tests/pd_sim/). For a quarter of the seeds a
stopped or dead sender's data goes on landing for 5 s (`Faults.drain_s`), longer than any
grace: only the decode node's data fences keep it out of reused blocks.

Invariants at every simulated step (`Cluster.check_step`): no block is handed to another
owner while a WRITE into it may still land; every request ends within its deadlines
plus grace; `check_integrity()` (holds claimed exactly by live transfers) on every node;
every step reads only KV equal to its true prefix (the stub runner). After each run both
pools are back to baseline and every finished request produced exactly its tokens.
`PD_SIM_SEEDS=N` runs more seeds; a failing seed reproduces with
`python -m tests.pd_sim.scenario SEED`.
"""

import logging
import os
import time

from pdserve.kv_transfer.base import RecvDone
from tests.pd_sim.cluster import Cluster
from tests.pd_sim.scenario import run_seed
from tests.pd_sim.world import Faults

SEEDS = int(os.environ.get("PD_SIM_SEEDS", "1000"))


def test_seeded_simulation_holds_every_invariant(caplog):
    caplog.set_level(logging.ERROR)
    logging.disable(logging.WARNING)
    failures = {}
    t0 = time.perf_counter()
    try:
        for seed in range(SEEDS):
            try:
                run_seed(seed)
            except AssertionError as e:
                failures[seed] = str(e)[:300]
    finally:
        logging.disable(logging.NOTSET)
    elapsed = time.perf_counter() - t0
    assert not failures, f"{len(failures)}/{SEEDS} seeds failed in {elapsed:.1f} s: {failures}"


def test_an_order_unread_during_a_prefill_stall_counts_as_prefill_queue():
    """A prefill node reads orders only between steps: an order that sat unread while the
    node was busy reports that wait in `prefill_queue` (from the control pump's receipt to
    the engine's read, both on the node's own clock), where the TTFT breakdown used to
    show it as `kv_transfer`."""
    c = Cluster(seed=0, faults=Faults(ctl_delay=0.0), num_prefill=1)  # hello before order
    done: list[RecvDone] = []
    poll = c.dside.poll

    def recording_poll():
        events = poll()
        done.extend(e for e in events if isinstance(e, RecvDone))
        return events

    c.dside.poll = recording_poll
    c.hang(c.addrs[0], 0.3)  # the engine is busy (its pump is not): a long step
    c.submit("r0", list(range(1, 40)), max_tokens=2)
    c.run_until_idle()
    assert c.reqs["r0"].finish == "length" and len(done) == 1
    queue, _ = done[0].prefill_node_s
    assert 0.25 <= queue <= 0.5, queue  # ~the stall, minus the order's own (<= 20 ms) trip


def test_a_preempted_request_whose_kv_came_from_a_prefill_node_is_recomputed_here():
    """A running request whose prompt KV landed from a prefill node, then preempted (the
    decode pool ran out), is recomputed on the decode node. Ordering it from the prefill
    node again sent the prompt alone while its blocks covered the tokens generated since:
    the KV of those positions never came, and the request went on over garbage (the stub
    model's KV check), or the order was refused and counted as a failure. Without a
    prefix cache nothing of it is left after the preemption (with one, a cached prefix
    leaves a suffix short enough to prefill here, unless it was evicted)."""
    c = Cluster(
        seed=0,
        faults=Faults(ctl_delay=0.0, write_delay=0.0, notif_delay=0.0),
        num_prefill=1,
        decode_blocks=5,  # a (2 blocks, growing to 5) and b (3 blocks) do not fit together
        prefill_budget=64,
        decode_caching=False,
    )
    c.submit("a", list(range(10, 18)), max_tokens=12)
    c.submit("b", list(range(30, 39)), max_tokens=3)
    c.run_until_idle()
    c.check_final()  # every token exact
    assert c.decode.scheduler.num_preemptions == 1
    assert c.drole.num_remote_prefills == 2 and c.drole.num_failures == 0
    assert {r: t.finish for r, t in c.reqs.items()} == {"a": "length", "b": "length"}
