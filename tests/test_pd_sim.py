"""The PD protocol under a seeded simulator: real DecodeRole/PrefillRole, real schedulers,
KV cache managers and connector sides (`kv_transfer.decode_side`/`prefill_side`, the real
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

from tests.pd_sim.scenario import run_seed

SEEDS = int(os.environ.get("PD_SIM_SEEDS", "300"))


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
