"""Workload C's prefill step (32 fresh prompts x 128 tokens, logits for the 32 last rows),
variants side by side in one process on the same weights, with Hugging Face's forward of
the same batch as the yardstick (robust to a loaded box: the variants alternate, each
keeps its fastest of `--rounds`, and wall and process CPU time are both reported).

    python benchmarks/prefill_step_ab.py --dtype float32 --out results/prefill_step_ab.json

Variants (the engine's eager model, only the kernel module of some ops swapped):
  reference: every op from pdserve.kernels.reference (PDSERVE_CPU_ATTENTION=reference; the
             prefill attention gathers K/V from the cache and runs SDPA's math path)
  native:    pdserve.kernels.cpu_ops, what `get_ops("torch")` serves (MLP in row tiles of
             pdserve.engine.models.llama.mlp_tile_rows)
  native_tileN: native with the MLP in tiles of N rows (native_tile0: one untiled MLP
             call over the whole step, as main did before the tiling)
  ..._sdpa:  (suffix) fresh prompts' attention through torch's flash SDPA instead of
             the native kernel (PDSERVE_PREFILL_ATTENTION=sdpa); native_tile0_sdpa is
             main before both changes
  ..._noglu: (suffix, before _sdpa) gate_up packed whole and SiLU * mul as its own
             native pass (what main did before PackedGateUp.silu_mul)
  native_refprefill: pdserve.kernels.cpu_ops with the reference's prefill attention (what main
             served before kernels/cpu_prefill.py)
  hf:        transformers' LlamaForCausalLM forward on the [32, 128] batch, logits of the
             last position only (what generate() computes for C)
The batch has real KV slots (distinct blocks per prompt), so store and gathers are real.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine_throughput import DTYPES, make_prompts  # noqa: E402
from pdserve.engine import LLM  # noqa: E402
from pdserve.engine.attention import AttentionMetadata  # noqa: E402
from pdserve.engine.models.cpu_linear import _packed, pack_weight  # noqa: E402
from pdserve.engine.models.llama import LlamaMLP  # noqa: E402
from pdserve.kernels import cpu_ops  # noqa: E402
from pdserve.kernels import reference as ref  # noqa: E402
from pdserve.kernels.cpu_prefill import PREFILL_ATTENTION_ENV  # noqa: E402

OP_MODULES = {
    "reference": ref,
    "native": cpu_ops,
    "native_refprefill": SimpleNamespace(
        **{
            **{n: getattr(cpu_ops, n) for n in cpu_ops.__all__},
            "paged_prefill_attention": ref.paged_prefill_attention,
        }
    ),  # fmt: skip
}


def set_ops(model, ops, tile_rows: int | None, glu: bool = True) -> None:
    """Point every module of the model that calls kernels at `ops`; MLP tiles of
    `tile_rows` rows (None: the engine's default); gate_up packed as halves with SiLU * mul
    fused into its GEMMs (glu), or packed whole with SiLU * mul apart."""
    for m in model.modules():
        if isinstance(m, LlamaMLP):
            m.tile_rows = tile_rows
            if isinstance(_packed(m.gate_up_proj.weight), tuple) != glu:
                pack_weight(m.gate_up_proj.weight, halves=glu)
        if hasattr(m, "ops"):
            m.ops = ops
        if hasattr(m, "attn"):  # PagedAttention is a plain object, not a submodule
            m.attn.ops = ops


def fresh_batch(prompts: list[list[int]], block_size: int):
    """Model inputs of one step prefilling every prompt from scratch, block i*w.. for
    prompt i (block 0 left unused, as the pool does)."""
    n, plen = len(prompts), len(prompts[0])
    w = -(-plen // block_size)
    table = (torch.arange(n * w, dtype=torch.int32) + 1).view(n, w)
    pos = torch.arange(plen).repeat(n)
    row = torch.arange(n).repeat_interleave(plen)
    slots = table[row, pos // block_size].long() * block_size + pos % block_size
    lens = torch.full((n,), plen, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=0,
        decode_block_tables=table[:0],
        decode_context_lens=lens[:0],
        prefill_block_tables=table,
        prefill_query_start_loc=(torch.arange(n + 1) * plen).to(torch.int32),
        prefill_seq_lens=lens,
    )
    return torch.tensor(prompts).flatten(), pos, meta


def timed(fn) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--variants", default="reference,native,hf")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/prefill_step_ab.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=True, num_blocks=1024,
              num_threads=args.threads)  # fmt: skip
    runner = llm.engine.runner
    model, kv = runner.model, runner.kv_cache
    prompts = make_prompts(args.prompts, args.prompt_len, llm.engine.vocab_size, seed=ord("C"))
    ids, pos, meta = fresh_batch(prompts, runner.block_size)
    last = (torch.arange(args.prompts) + 1) * args.prompt_len - 1
    steps, setups = {}, {}  # setups[v]: switches the model to v, outside the timing
    for v in args.variants.split(","):
        setups[v] = lambda: None
        if v == "hf":
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(str(llm.engine.model_dir),
                                                      dtype=DTYPES[args.dtype]).eval()  # fmt: skip
            hf_ids = torch.tensor(prompts)
            steps[v] = lambda hf=hf, ids=hf_ids: hf(input_ids=ids, logits_to_keep=1,
                                                    use_cache=False).logits  # fmt: skip
        else:
            base, sdpa = v.removesuffix("_sdpa"), v.endswith("_sdpa")
            base, glu = base.removesuffix("_noglu"), not base.endswith("_noglu")
            base, _, tile = base.partition("_tile")
            ops = OP_MODULES[base]
            tile_rows = int(tile) if tile else None

            def setup(ops=ops, tile_rows=tile_rows, attn="sdpa" if sdpa else "native", glu=glu):
                set_ops(model, ops, tile_rows, glu)
                os.environ[PREFILL_ATTENTION_ENV] = attn

            setups[v] = setup
            steps[v] = lambda: model.compute_logits(model(ids, pos, kv, meta)[last])
    best = {v: [float("inf"), float("inf")] for v in steps}
    with torch.inference_mode():
        outs = {}  # warm, and the outputs to compare
        for v, fn in steps.items():
            setups[v]()
            outs[v] = fn()
        for _ in range(args.rounds):
            for v, fn in steps.items():
                setups[v]()
                wall, cpu = timed(fn)
                best[v] = [min(best[v][0], wall), min(best[v][1], cpu)]
    base = outs[next(iter(outs))].reshape(args.prompts, -1).float()
    tokens = args.prompts * args.prompt_len
    res = {"dtype": args.dtype, "threads": args.threads, "tokens": tokens, "variants": {}}
    for v, (wall, cpu) in best.items():
        diff = (outs[v].reshape(args.prompts, -1).float() - base).abs().max().item()
        same = bool((outs[v].reshape(args.prompts, -1).argmax(-1) == base.argmax(-1)).all())
        res["variants"][v] = {
            "wall_ms": round(wall * 1e3, 1),
            "cpu_ms": round(cpu * 1e3, 1),
            "prompt_tok_s": round(tokens / wall, 1),
            "max_abs_logit_diff": round(diff, 5),
            "same_argmax": same,
        }
    names = list(best)
    for v in names:
        for other in names:
            if other != v:
                res["variants"][v][f"speedup_vs_{other}"] = round(best[other][0] / best[v][0], 2)
    print(json.dumps(res, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
