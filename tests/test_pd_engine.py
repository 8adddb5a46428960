"""PD roles over real NIXL, two engines driven from one test process (fast, debuggable).

The cross-process, HTTP-level PD tests live in test_pd_serving.py; here the same roles and
connector run with both engine loops stepped alternately, so every state can be asserted.
"""

import random
import time

import msgspec
import pytest

from pdserve.decode.role import DecodeRole
from pdserve.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv_transfer.nixl_connector import nixl_connector
from pdserve.prefill.role import PrefillRole
from tests.hf_reference import hf_greedy, load_hf

pytest.importorskip("nixl")


def make_config(tiny_llama_dir, *, num_blocks=256, budget=32, local_max=4, layout="layer_major"):
    return EngineConfig(
        model=ModelConfig(tiny_llama_dir),
        cache=CacheConfig(block_size=4, num_blocks=num_blocks, kv_layout=layout),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget, local_prefill_max_tokens=local_max
        ),
        num_threads=1,
    )


class Pair:
    def __init__(
        self,
        tiny_llama_dir,
        timeout_s=10.0,
        prefill_locally=True,
        layouts=("layer_major", "layer_major"),  # (prefill node's, decode node's)
        **kw,
    ):
        self.pconn = nixl_connector(
            node_id="p", role="prefill", control_address="tcp://127.0.0.1:*"
        )
        pcfg = make_config(tiny_llama_dir, layout=layouts[0], **kw)
        self.prefill = EngineCore(pcfg, PrefillRole(self.pconn))
        self.dconn = nixl_connector(node_id="d", role="decode")
        self.drole = DecodeRole(
            self.dconn, transfer_timeout_s=timeout_s, prefill_locally_on_failure=prefill_locally
        )
        self.decode = EngineCore(make_config(tiny_llama_dir, layout=layouts[1], **kw), self.drole)
        self.addr = self.pconn.control_address

    def run(self, prompts, params, max_s=60.0, step_prefill=True):
        outs = {}
        for i, p in enumerate(prompts):
            self.decode.add_request(f"r{i}", p, params, remote_prefill=self.addr)
        deadline = time.monotonic() + max_s
        while self.decode.has_unfinished or (step_prefill and self.prefill.has_unfinished):
            assert time.monotonic() < deadline, "PD pair did not finish"
            for o in self.decode.step():
                outs.setdefault(o.request_id, []).append(o)
            if step_prefill:
                assert self.prefill.step() == []  # prefill orders never output locally
        return [outs[f"r{i}"] for i in range(len(prompts))]

    def close(self):
        self.drole.shutdown()
        self.prefill.kv_role.shutdown()


def tokens(outs):
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return load_hf(tiny_llama_dir)


def prompts_of(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 1024) for _ in range(n)] for n in lengths]


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_pd_greedy_equals_hf(tiny_llama_dir, hf_model):
    pair = Pair(tiny_llama_dir)
    try:
        prompts = prompts_of([9, 40, 77, 16, 4, 130], seed=1)
        results = pair.run(prompts, GREEDY)
        for p, outs in zip(prompts, results):
            assert tokens(outs) == hf_greedy(hf_model, p, 8)
            assert outs[-1].finish_reason == "length"
            assert outs[0].timings.prefill == ("local_policy" if len(p) == 4 else "remote")
        assert pair.drole.num_remote_prefills == 5  # the 4-token prompt was prefilled locally
        assert pair.decode.stats().prefill_paths == {"remote": 5, "local_policy": 1}
        assert pair.dconn.num_checksum_mismatches == 0  # every block verified (on by default)
        for core in (pair.decode, pair.prefill):
            core.check_integrity()
            assert core.kv.pool.num_used_blocks == 0
    finally:
        pair.close()


def test_corrupt_or_lying_kv_is_caught_by_its_checksum(tiny_llama_dir, hf_model, monkeypatch):
    """Issue 30: a prefill peer whose done carries wrong checksums, then bytes flipped in
    a landed block (PDSERVE_KV_CORRUPT, kv_transfer/kv_verify.py): both caught before the
    request decodes, counted, and each request still ends exactly as transformers."""
    pair = Pair(tiny_llama_dir)
    try:
        honest = pair.pconn._sealed

        def lying(done):  # a hostile (or broken) prefill node: every checksum off by one bit
            return honest(msgspec.structs.replace(done, checksums=[x ^ 1 for x in done.checksums]))

        pair.pconn._sealed = lying
        p1, p2 = prompts_of([40, 23], seed=9)
        (outs,) = pair.run([p1], GREEDY)
        assert tokens(outs) == hf_greedy(hf_model, p1, 8)
        assert outs[0].timings.prefill == "local_checksum_mismatch"
        assert pair.dconn.num_checksum_mismatches == 1
        pair.pconn._sealed = honest
        monkeypatch.setenv("PDSERVE_KV_CORRUPT", "1")
        (outs,) = pair.run([p2], GREEDY)
        assert tokens(outs) == hf_greedy(hf_model, p2, 8)
        assert outs[0].timings.prefill == "local_checksum_mismatch"
        stats = pair.decode.stats()
        assert stats.kv_checksum_mismatches == 2 and stats.pd_failures == 2
        assert stats.prefill_paths == {"local_checksum_mismatch": 2}
        for core in (pair.decode, pair.prefill):
            core.check_integrity()
            assert core.kv.pool.num_used_blocks == 0
    finally:
        pair.close()


def test_only_uncached_blocks_cross(tiny_llama_dir, hf_model):
    pair = Pair(tiny_llama_dir)
    try:
        shared = prompts_of([40], seed=2)[0]
        pair.run([shared + [7, 8, 9, 10, 11, 12]], GREEDY)
        sent_before = pair.prefill.kv_role.bytes_sent
        p2 = shared + prompts_of([20], seed=3)[0]
        (outs,) = pair.run([p2], GREEDY)
        assert tokens(outs) == hf_greedy(hf_model, p2, 8)
        layout = pair.dconn.data.layout
        # decode had 40 tokens = 10 blocks cached; 60-token prompt = 15 blocks: 5 cross
        assert (
            pair.prefill.kv_role.bytes_sent - sent_before
            == 5 * layout.block_bytes * 2 * layout.num_layers
        )
        assert outs[0].num_cached_tokens == 40
    finally:
        pair.close()


def test_prefill_never_answers_times_out_then_local(tiny_llama_dir, hf_model):
    pair = Pair(tiny_llama_dir, timeout_s=0.5)
    try:
        p = prompts_of([30], seed=4)[0]
        (outs,) = pair.run([p], GREEDY, step_prefill=False)  # prefill node never steps
        assert tokens(outs) == hf_greedy(hf_model, p, 8)  # prefilled locally after the deadline
        assert pair.drole.num_failures == 1
        pair.decode.check_integrity()
        assert pair.decode.kv.pool.num_used_blocks == 0  # held blocks released after grace
    finally:
        pair.close()


def test_a_fence_drops_incoming_kv_connections_and_the_peer_is_introduced_again(
    tiny_llama_dir, hf_model
):
    """An attempt the prefill node never answers is fenced: the decode node drops every
    incoming KV connection (its NIXL agent rebuilt, a new address) before the blocks are
    released, and says hello again; the same prefill node's next transfer reaches the new
    agent, and its tokens equal Hugging Face's."""
    pair = Pair(tiny_llama_dir, timeout_s=0.5)
    try:
        first_md = pair.dconn.data.local_metadata()
        p, q = prompts_of([30, 41], seed=9)
        (outs,) = pair.run([p], GREEDY, step_prefill=False)  # the prefill node never steps
        assert tokens(outs) == hf_greedy(hf_model, p, 8)  # prefilled locally
        assert pair.dconn.num_data_fences == 1 and pair.dconn.data.incoming_fences == 1
        assert pair.decode.stats().kv_data_fences == 1
        assert pair.dconn.data.local_metadata() != first_md  # a new UCX worker address
        assert pair.decode.kv.pool.num_used_blocks == 0
        (outs,) = pair.run([q], GREEDY)  # now it steps: hellos, then the new order
        assert tokens(outs) == hf_greedy(hf_model, q, 8)
        assert outs[0].timings.prefill == "remote"
        for core in (pair.decode, pair.prefill):
            core.check_integrity()
            assert core.kv.pool.num_used_blocks == 0
    finally:
        pair.close()


def test_prefill_failure_ends_with_error(tiny_llama_dir):
    pair = Pair(tiny_llama_dir, timeout_s=0.3, prefill_locally=False)
    try:
        (outs,) = pair.run([prompts_of([30], seed=5)[0]], GREEDY, step_prefill=False)
        assert outs[-1].finish_reason == "error" and "within" in outs[-1].error
        pair.decode.check_integrity()
        assert pair.decode.kv.pool.num_used_blocks == 0
    finally:
        pair.close()


def test_abort_on_decode_frees_prefill(tiny_llama_dir):
    pair = Pair(tiny_llama_dir, budget=4)  # 4-token chunks: the prefill takes many steps
    try:
        p = prompts_of([120], seed=6)[0]
        pair.decode.add_request("a", p, GREEDY, remote_prefill=pair.addr)
        deadline = time.monotonic() + 10
        while not (
            "a@1" in pair.prefill.requests and pair.prefill.requests["a@1"].num_computed_tokens >= 8
        ):
            assert time.monotonic() < deadline
            pair.decode.step()
            pair.prefill.step()
        assert pair.prefill.requests["a@1"].num_computed_tokens < 120  # prefill is mid-way
        pair.decode.abort_requests(["a"])
        deadline = time.monotonic() + 10
        while pair.decode.has_unfinished or pair.prefill.has_unfinished:
            assert time.monotonic() < deadline
            pair.decode.step()
            pair.prefill.step()
        for core in (pair.decode, pair.prefill):
            core.check_integrity()
            assert core.kv.pool.num_used_blocks == 0
        assert "a@1" not in pair.prefill.requests
    finally:
        pair.close()


def test_admission_needs_room_for_the_whole_prompt(tiny_llama_dir, hf_model):
    # 20 blocks of 4 tokens; each 50-token prompt needs 13 blocks: only one fits at a time.
    pair = Pair(tiny_llama_dir, num_blocks=20)
    try:
        prompts = prompts_of([50, 50], seed=7)
        for i, p in enumerate(prompts):
            pair.decode.add_request(f"r{i}", p, GREEDY, remote_prefill=pair.addr)
        pair.decode.step()
        sched = pair.decode.scheduler
        assert list(sched.remote_waiting) == ["r0"] and [r.request_id for r in sched.waiting] == [
            "r1"
        ]
        assert pair.decode.kv.pool.num_used_blocks == 13  # the whole prompt, nothing more
        outs = {}
        deadline = time.monotonic() + 60
        while pair.decode.has_unfinished or pair.prefill.has_unfinished:
            assert time.monotonic() < deadline
            for o in pair.decode.step():
                outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            pair.prefill.step()
        for i, p in enumerate(prompts):
            assert outs[f"r{i}"] == hf_greedy(hf_model, p, 8)
        pair.decode.check_integrity()
    finally:
        pair.close()


def test_hostile_decode_peer_is_rejected_over_real_nixl(tiny_llama_dir, hf_model):
    """Used to raise inside the prefill engine loop (killing a shared prefill node): a peer
    with another KV layout, and orders with out-of-range or duplicate block ids."""
    import torch
    import zmq

    from pdserve.kv_transfer import messages as m
    from pdserve.kv_transfer.nixl_transport import NixlTransport

    pair = Pair(tiny_llama_dir)
    ctx = zmq.Context()
    agents = []
    try:

        def hostile(name, block_size):
            kv = torch.zeros(2, 2, 16, block_size, 2, 16)
            agent = NixlTransport(name, kv, progress_thread=False)
            agents.append(agent)
            sock = ctx.socket(zmq.DEALER)
            sock.connect(pair.addr)
            sock.send(m.encode(m.PeerHello(agent_metadata=agent.local_metadata())))
            return agent, sock

        def order(agent, dst):
            return m.encode(
                m.PrefillOrder(
                    request_id="evil",
                    attempt=len(dst),
                    prompt_token_ids=list(range(3, 3 + 4 * len(dst))),
                    params=GREEDY,
                    decode_agent=agent.name,
                    first_block=0,
                    dst_block_ids=dst,
                    ttl_s=60.0,
                )
            )

        def reply(sock):
            deadline = time.monotonic() + 30
            while not sock.poll(0):
                assert time.monotonic() < deadline
                pair.prefill.step()
            return m.decode_to_decode(sock.recv())

        wrong, s1 = hostile("evil-layout", block_size=8)
        s1.send(order(wrong, [0, 1]))
        r = reply(s1)
        assert isinstance(r, m.PrefillRejected) and "incompatible KV layouts" in r.reason
        right, s2 = hostile("evil-ids", block_size=4)
        for dst, why in (([0, 99], "outside"), ([3, 3], "duplicate"), ([-1, 0], "outside")):
            s2.send(order(right, dst))
            r = reply(s2)
            assert isinstance(r, m.PrefillRejected) and why in r.reason, r
        assert not pair.prefill.requests and pair.prefill.kv.pool.num_used_blocks == 0
        prompts = prompts_of([30, 17], seed=9)  # the prefill node still serves honest peers
        for p, outs in zip(prompts, pair.run(prompts, GREEDY)):
            assert tokens(outs) == hf_greedy(hf_model, p, 8)
        pair.prefill.check_integrity()
    finally:
        for a in agents:
            a.close()
        ctx.destroy(linger=0)
        pair.close()


def test_fallback_share_over_the_setting_is_logged_once_a_minute(caplog):
    """Issue 30: more than `fallback_warn_share` of the recent remote prefills computed
    here after a failed transfer: one warning (not one per request)."""
    from pdserve.decode.role import FallbackWatch

    watch = FallbackWatch(0.25)
    for i in range(40):
        watch.record(i % 2 == 0)  # 50% fell back
    warnings = [r for r in caplog.records if "remote prefills were computed here" in r.message]
    assert len(warnings) == 1 and "50% of the last 20" in warnings[0].message
    quiet = FallbackWatch(0.6)
    for i in range(40):
        quiet.record(i % 2 == 0)
    assert len([r for r in caplog.records if "computed here" in r.message]) == 1
