"""gpu_check sections on PD over NIXL: two engine processes, and a raw 256 MiB WRITE.

`python benchmarks/_gpu_pd.py --raw-role target|initiator ...` is the child process
of the raw WRITE check; gpu_check.py starts both and reads their result files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks._gpu_common import Skip, first_mismatch, random_prompts  # noqa: E402

logger = logging.getLogger("gpu_check.pd")
UCX_LINE = re.compile(r"cuda_ipc|cuda_copy|gdr_copy|\brc_|\bdc_|\bud_|tcp|cma|sysv|posix|knem")


def sections(ctx: dict) -> list:
    return [("pd_nixl", lambda: pd_two_processes(ctx)), ("nixl_raw", lambda: raw_write(ctx))]


def _need_nixl() -> None:
    if importlib.util.find_spec("nixl") is None:
        raise Skip("nixl is not importable here; ship its wheels (scripts/gpu_wheels.sh)")


def _config(ctx: dict, model_dir: str, **kv):
    from pdserve.engine.config import (
        CacheConfig,
        EngineConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
    )

    return EngineConfig(
        model=ModelConfig(model_dir, "float32", ctx["device"], "triton"),
        cache=CacheConfig(block_size=16, num_blocks=512 if ctx["cuda"] else 128),
        # 0: every prompt is prefilled on the prefill node, however short
        scheduler=SchedulerConfig(
            max_num_batched_tokens=256 if ctx["cuda"] else 32, local_prefill_max_tokens=0
        ),  # fmt: skip
        # Interpreted kernels make a prefill step take seconds: a patient liveness check.
        kv_transfer=KVTransferConfig(peer_timeout_s=10.0 if ctx["cuda"] else 120.0, **kv),
    )


def _registered_memory(core) -> str:
    """What NIXL registered the node's KV cache as (the connector's data plane)."""
    connector = core.kv_role.connector
    for attr in ("data", "transport"):  # the side's NixlTransport
        transport = getattr(connector, attr, None)
        if hasattr(transport, "registered_memory"):
            return transport.registered_memory
    raise RuntimeError(f"{type(connector).__name__} exposes no NIXL transport (data/transport)")


def _prefill_main(ctx: dict, model_dir: str, address: str, stop, results) -> None:
    """The prefill node: step its engine until told to stop, then report its PD stats."""
    if not ctx["cuda"]:
        os.environ["TRITON_INTERPRET"] = "1"
    from pdserve.engine.core import EngineCore
    from pdserve.node.roles import build_kv_role

    cfg = _config(ctx, model_dir, role="prefill", node_id="gpucheck-p", control_address=address)
    core = EngineCore(cfg, build_kv_role(cfg))
    results.put({"ready": True})
    while not stop.is_set():
        core.step()
        if core.last_step_idle:
            time.sleep(0.001)
    stats = core.stats()
    results.put({"kv_bytes_sent": stats.kv_bytes_sent, "pd_orders": stats.pd_orders,
                 "registered_memory": _registered_memory(core)})  # fmt: skip
    core.kv_role.shutdown()


def pd_two_processes(ctx: dict) -> dict:
    """Prefill in a child process, decode here: tokens equal to a colocated engine's."""
    _need_nixl()
    from benchmarks._gpu_engine import model_dir as make_model
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.core import EngineCore
    from pdserve.node.roles import build_kv_role

    model_dir = make_model(ctx, "hd64_gqa9to3")
    lengths = [17, 300, 1500] if ctx["cuda"] else [17, 36]
    prompts = random_prompts(lengths, 512, seed=7)
    params = SamplingParams(temperature=0, max_tokens=12 if ctx["cuda"] else 3, ignore_eos=True)
    colocated = LLM(model_dir, dtype="float32", device=ctx["device"], kernel_backend="triton",
                    block_size=16, num_blocks=512 if ctx["cuda"] else 128,
                    max_num_batched_tokens=256 if ctx["cuda"] else 32)  # fmt: skip
    expected = [o.token_ids for o in colocated.generate(prompts, params)]
    del colocated

    address = f"ipc://{ctx['workdir']}/prefill-control"
    spawn = mp.get_context("spawn")
    stop, results = spawn.Event(), spawn.Queue()
    child = spawn.Process(target=_prefill_main, args=(ctx, model_dir, address, stop, results))
    child.start()
    try:
        results.get(timeout=180)  # the prefill engine is up
        cfg = _config(ctx, model_dir, role="decode", node_id="gpucheck-d",
                      prefill_nodes=(address,))  # fmt: skip
        core = EngineCore(cfg, build_kv_role(cfg))
        for i, p in enumerate(prompts):
            core.add_request(f"pd{i}", p, params, remote_prefill=address)
        got: dict[str, list[int]] = {f"pd{i}": [] for i in range(len(prompts))}
        errors = []
        deadline = time.monotonic() + 180
        while core.has_unfinished and time.monotonic() < deadline:
            for out in core.step():
                got[out.request_id].extend(out.new_token_ids)
                if out.error:
                    errors.append(f"{out.request_id}: {out.error}")
        timed_out = core.has_unfinished
        stats = core.stats()
        decode_mem = _registered_memory(core)
        core.check_integrity()
        core.kv_role.shutdown()
        stop.set()
        prefill = results.get(timeout=120)
    finally:
        stop.set()
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    tokens = [got[f"pd{i}"] for i in range(len(prompts))]
    want_mem = "VRAM_SEG" if ctx["cuda"] else "DRAM_SEG"
    mismatches = [first_mismatch(a, b) for a, b in zip(tokens, expected)]
    checks = {
        "equal_to_colocated": all(m is None for m in mismatches),
        "first_mismatch": mismatches,
        "remote_prefills": stats.pd_remote_prefills,
        "remote_prefill_failures": stats.pd_failures,
        "kv_bytes_received": stats.kv_bytes_received,
        "kv_bytes_sent": prefill["kv_bytes_sent"],
        "registered_memory": {"decode": decode_mem, "prefill": prefill["registered_memory"]},
        "errors": errors,
        "timed_out": timed_out,
    }
    failed = (
        not checks["equal_to_colocated"]
        or timed_out
        or errors
        or stats.pd_remote_prefills != len(prompts)
        or stats.pd_failures
        or stats.kv_bytes_received == 0
        or stats.kv_bytes_received != prefill["kv_bytes_sent"]
        or decode_mem != want_mem
        or prefill["registered_memory"] != want_mem
        or child.exitcode != 0
    )
    return {"failed": bool(failed), "prompt_lens": lengths, **checks}


# ------------------------------------------------------------------------ raw WRITE


def _raw_shape(cuda: bool) -> tuple[int, ...]:
    # [layers, 2, blocks, block_size, kv_heads, head_dim] bf16: 256 MiB on a GPU
    return (8, 2, 512, 16, 8, 128) if cuda else (2, 2, 32, 4, 1, 16)


def _raw_mapping(num_blocks: int) -> tuple[list[int], list[int]]:
    """Every block, in runs of 16 whose order is shuffled on the destination side."""
    runs = [list(range(i, min(i + 16, num_blocks))) for i in range(0, num_blocks, 16)]
    order = list(range(len(runs)))
    order = order[1::2] + order[::2]
    dst = [b for i in order for b in runs[i]]
    return list(range(num_blocks)), dst


def _raw_child(role: str, workdir: Path, cuda: bool) -> None:
    from pdserve.kv_transfer.nixl_transport import NixlTransport, TransferState

    device = "cuda" if cuda else "cpu"
    shape = _raw_shape(cuda)
    gen = torch.Generator(device=device).manual_seed(0)
    # Random bit patterns, compared as int16 (some are NaNs as bf16).
    bits = torch.randint(-(2**15), 2**15, shape, generator=gen, device=device, dtype=torch.int16)
    md_file, out = workdir / "raw_target.md", workdir / f"raw_{role}.json"
    src, dst = _raw_mapping(shape[2])
    if role == "target":
        kv = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        t = NixlTransport("gpucheck-raw-target", kv)
        md_file.write_bytes(t.local_metadata())
        deadline, done = time.monotonic() + 120, False
        while not done and time.monotonic() < deadline:
            done = any(b"check" in m for ms in t.get_notifs().values() for m in ms)
            time.sleep(0.001)
        equal = done and torch.equal(kv.view(torch.int16)[:, :, dst], bits[:, :, src])
        result = {"notified": done, "torch_equal": bool(equal), "memory": t.registered_memory}
    else:
        kv = bits.view(torch.bfloat16)
        t = NixlTransport("gpucheck-raw-initiator", kv)
        deadline = time.monotonic() + 120
        while not md_file.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        peer = t.add_peer(md_file.read_bytes())
        if cuda:
            torch.cuda.synchronize()
        times = []
        for i in range(6):  # the first one warms the endpoint; the last one notifies
            t0 = time.perf_counter()
            h = t.write_blocks(peer, src, dst, notif=b"check" if i == 5 else None)
            state = t.wait(h, timeout_s=60)
            times.append(time.perf_counter() - t0)
            t.release(h)
            if state is not TransferState.DONE:
                raise RuntimeError(f"write {i} ended {state.name}")
        nbytes = kv.numel() * kv.element_size()
        best = min(times[1:])
        result = {"bytes": nbytes, "seconds": [round(x, 5) for x in times],
                  "gbps_best": round(nbytes / best / 1e9, 2),
                  "gbps_median": round(nbytes / sorted(times[1:])[2] / 1e9, 2),
                  "memory": t.registered_memory}  # fmt: skip
        time.sleep(0.5)  # let the target see the notification before we go
    t.close()
    out.write_text(json.dumps(result))


def raw_write(ctx: dict) -> dict:
    """A 256 MiB write_blocks between two processes, verified with torch.equal."""
    _need_nixl()
    workdir = Path(ctx["workdir"]) / "raw"
    workdir.mkdir(exist_ok=True)
    env = {**os.environ, "UCX_PROTO_INFO": "y", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env["PYTHONPATH"]) if p)
    procs = {}
    for role in ("target", "initiator"):
        cmd = [sys.executable, __file__, "--raw-role", role, "--workdir", str(workdir)]
        if ctx["cuda"]:
            cmd.append("--cuda")
        procs[role] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True)  # fmt: skip
    logs = {}
    for role, p in procs.items():
        try:
            logs[role] = p.communicate(timeout=180)[0]
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            return {"failed": True, "error": f"raw write {role} did not finish in 180 s"}
    results = {}
    for role, p in procs.items():
        f = workdir / f"raw_{role}.json"
        if p.returncode != 0 or not f.exists():
            return {"failed": True, "role": role, "returncode": p.returncode,
                    "log_tail": logs[role][-3000:]}  # fmt: skip
        results[role] = json.loads(f.read_text())
    ucx = [ln.strip() for ln in logs["initiator"].splitlines() if UCX_LINE.search(ln)]
    want_mem = "VRAM_SEG" if ctx["cuda"] else "DRAM_SEG"
    ok = results["target"]["torch_equal"] and results["target"]["memory"] == want_mem
    return {"failed": not ok, **results, "ucx_transport_lines": ucx[:40],
            "ucx_lines_total": len(ucx)}  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--raw-role", choices=["target", "initiator"], required=True)
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--cuda", action="store_true")
    a = ap.parse_args()
    logging.basicConfig(level=logging.INFO)
    _raw_child(a.raw_role, a.workdir, a.cuda)
