"""The PD protocol under a seeded simulator: real DecodeRole/PrefillRole, real schedulers,
KV cache managers and connector sides (`pdserve.kv_transfer.decode_side`/`prefill_side`, the real
`DecodeControl` liveness and queues) over an in-memory transport that delays, reorders
and drops control messages, delays and fails WRITEs, stalls and kills prefill nodes, and
aborts and retries requests at random points (tests/pd_sim/).

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
