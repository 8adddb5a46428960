"""PD between engines of different tensor-parallel sizes (real NIXL, real TP ranks over gloo).

The prefill engine of TP a computes a prompt's KV in its ranks' caches; its one NIXL agent
WRITEs each KV head into every decode rank that holds it (kv_transfer/tp_staging.py);
the decode engine of TP b then generates. Greedy tokens must equal transformers, every
block must pass its one-device checksum, and both engines end with no block used.
Tiny random Llamas: 2 KV heads (sharded over 2 ranks) and 1 KV head (replicated).
"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.decode.role import DecodeRole
from pdserve.engine.core import EngineCore
from pdserve.kv_transfer.nixl_connector import nixl_connector
from pdserve.prefill.role import PrefillRole
from tests.conftest import make_tiny_llama
from tests.hf_reference import hf_greedy, load_hf
from tests.test_pd_engine import GREEDY, make_config, prompts_of, tokens

pytest.importorskip("nixl")


class TPPair:
    """A prefill engine of TP `tps[0]` and a decode engine of TP `tps[1]`, in this process."""

    def __init__(self, model_dir: str, tps: tuple[int, int], layout: str = "layer_major"):
        def config(tp):
            cfg = make_config(model_dir, layout=layout, num_blocks=128)
            return dataclasses.replace(cfg, tensor_parallel_size=tp, num_threads=max(tp, 1))

        self.cores: list[EngineCore] = []
        self.pconn = nixl_connector(
            node_id="p", role="prefill", control_address="tcp://127.0.0.1:*"
        )
        self.prefill = EngineCore(config(tps[0]), PrefillRole(self.pconn))
        self.cores.append(self.prefill)
        self.dconn = nixl_connector(node_id="d", role="decode")
        self.drole = DecodeRole(self.dconn, transfer_timeout_s=60, prefill_locally_on_failure=False)
        self.decode = EngineCore(config(tps[1]), self.drole)
        self.cores.append(self.decode)

    def run(self, prompts):
        import time

        outs: dict[str, list] = {}
        for i, p in enumerate(prompts):
            self.decode.add_request(f"r{i}", p, GREEDY, remote_prefill=self.pconn.control_address)
        deadline = time.monotonic() + 240
        while self.decode.has_unfinished or self.prefill.has_unfinished:
            assert time.monotonic() < deadline, "PD pair did not finish"
            for o in self.decode.step():
                outs.setdefault(o.request_id, []).append(o)
            assert self.prefill.step() == []
        return [outs[f"r{i}"] for i in range(len(prompts))]

    def close(self):
        self.drole.shutdown()
        self.prefill.kv_role.shutdown()
        for core in self.cores:
            close = getattr(core.runner, "close", None)
            if close is not None:
                close()


@pytest.fixture(scope="module", params=[2, 1], ids=["kv2", "kv1"])
def model(request, tmp_path_factory):
    kv = request.param
    path = make_tiny_llama(str(tmp_path_factory.mktemp(f"tppd_kv{kv}")), num_key_value_heads=kv)
    return path, load_hf(path)


@pytest.mark.parametrize("tps", [(1, 2), (2, 1), (2, 2)], ids=["1to2", "2to1", "2to2"])
def test_pd_between_tp_sizes_equals_hf(model, tps):
    path, hf = model
    pair = TPPair(path, tps)
    try:
        prompts = prompts_of([9, 40, 77], seed=sum(tps))
        results = pair.run(prompts)
        ranks = [core.kv_ranks for core in pair.cores]
        assert [len(r.caches) if r else 1 for r in ranks] == list(tps)
        (peer,) = pair.pconn.data.peers
        assert pair.pconn.data.peer_layout(peer).tp_size == tps[1]
        for p, outs in zip(prompts, results):
            assert tokens(outs) == hf_greedy(hf, p, 8), (tps, len(p))
            assert outs[0].timings.prefill == "remote"
        assert pair.drole.num_remote_prefills == len(prompts)
        assert pair.dconn.num_checksum_mismatches == 0
        sent = pair.pconn.data.stats
        assert sent.bytes > 0
        for core in pair.cores:
            core.check_integrity()
            assert core.kv.pool.num_used_blocks == 0
    finally:
        pair.close()
