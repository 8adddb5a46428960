"""The TP ranks' start-up wait (engine/tp_shard.py `Comm`): the ranks meet in the store
before the process group forms, for at most the start timeout; a peer that died while
starting ends the wait within about a second. No model: one rank alone in its store."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.engine.tp_shard import Comm


def test_a_rank_alone_waits_out_the_start_timeout(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="not every rank started in 2 s"):
        Comm(str(tmp_path / "store"), 0, 2, torch.device("cpu"), 8.0, start_timeout_s=2.0)
    took = time.monotonic() - t0
    assert 2.0 <= took < 30, took


def test_a_peer_that_exited_ends_the_wait_at_once(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="a peer exited while starting"):
        Comm(str(tmp_path / "store"), 0, 2, torch.device("cpu"), 8.0,
             start_timeout_s=600.0, peers_alive=lambda: False)  # fmt: skip
    assert time.monotonic() - t0 < 30  # about a second, not the 600 s
