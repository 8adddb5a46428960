"""`pdserve bench serve`: load an OpenAI-compatible endpoint and report serving metrics.

    pdserve bench serve --base-url http://127.0.0.1:8100 --dataset random \
        --input-len 128 --output-len 128 --num-prompts 64 --request-rate 0.5 1 inf \
        --goodput ttft:1000 tpot:200 --out results/serve.json

Each `--request-rate` is one run (a sweep when several), with the same prompts. Writes
the JSON report (config, versions, per-run metrics, server counters, per-request records)
and, unless `--no-plots`, PNG plots beside it; prints a summary table per run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

import httpx

from pdserve.bench.client import EndpointConfig
from pdserve.bench.datasets import (
    DatasetError,
    random_requests,
    resolve_tokenizer,
    shared_prefix_requests,
    sharegpt_requests,
)
from pdserve.bench.metrics import parse_goodput
from pdserve.bench.report import format_summary
from pdserve.bench.runner import run_level

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8100")
    g.add_argument("--endpoint", default="/v1/completions",
                   choices=["/v1/completions", "/v1/chat/completions"])  # fmt: skip
    g.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer.json, a model directory, or a pdserve built-in model name")  # fmt: skip
    g.add_argument("--no-ignore-eos", action="store_true",
                   help="let requests stop at EOS (default: ignore_eos, exact output lengths)")  # fmt: skip
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--extra-body", type=json.loads, default={},
                   help='JSON merged into every request body, e.g. \'{"logprobs": 0}\'')  # fmt: skip
    g.add_argument("--metrics-url", action="append", default=None,
                   help="Prometheus page(s) to read counters from before/after "
                        "(repeatable; default BASE_URL/metrics)")  # fmt: skip
    d = p.add_argument_group("dataset")
    d.add_argument("--dataset", default="random", choices=["random", "shared-prefix", "sharegpt"])
    d.add_argument("--dataset-path", default=None, help="sharegpt: the JSON file")
    d.add_argument("--num-prompts", type=int, default=64)
    d.add_argument("--input-len", type=int, default=128)
    d.add_argument("--output-len", type=int, default=128)
    d.add_argument("--range-ratio", type=float, default=0.0)
    d.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens per prefix")
    d.add_argument("--num-groups", type=int, default=4, help="shared-prefix: distinct prefixes")
    d.add_argument("--sharegpt-output-len", type=int, default=None)
    d.add_argument("--vocab-size", type=int, default=None,
                   help="random ids below this (default: the tokenizer's, else 1000)")  # fmt: skip
    d.add_argument("--seed", type=int, default=0,
                   help="dataset and arrival seed of the first rate; the i-th rate uses SEED+i, "
                        "so no rate's prompts are already in the server's prefix cache "
                        "from the one before")  # fmt: skip
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                      help="requests/s, one run each ('inf': all at once)")  # fmt: skip
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrivals: 1 Poisson, <1 burstier")  # fmt: skip
    load.add_argument("--max-concurrency", type=int, default=None)
    out = p.add_argument_group("results")
    out.add_argument("--goodput", nargs="+", default=[], metavar="METRIC:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:100 e2el:20000")  # fmt: skip
    out.add_argument("--percentiles", type=float, nargs="+", default=[50, 90, 99])
    out.add_argument("--out", type=Path, default=Path("results/bench_serve.json"))
    out.add_argument("--label", default=None, help="name of this run in compare tables")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")


def build_requests(args: argparse.Namespace, is_chat: bool, seed: int, tok):
    """The dataset of one run, drawn with `seed`; `tok` from `resolve_tokenizer` (or None)."""
    vocab = args.vocab_size or (tok.vocab_size if tok else 1000)
    as_text = is_chat and tok is not None
    if args.dataset == "random":
        reqs = random_requests(args.num_prompts, args.input_len, args.output_len,
                               args.range_ratio, seed, vocab, as_text, tok)  # fmt: skip
    elif args.dataset == "shared-prefix":
        reqs = shared_prefix_requests(args.num_prompts, args.num_groups, args.prefix_len,
                                      args.input_len, args.output_len, seed, vocab,
                                      as_text, tok)  # fmt: skip
    else:
        if not args.dataset_path:
            raise DatasetError("--dataset sharegpt needs --dataset-path FILE")
        reqs = sharegpt_requests(args.dataset_path, args.num_prompts, seed, tok,
                                 args.sharegpt_output_len)  # fmt: skip
    return reqs


def _server_info(base_url: str) -> dict:
    info: dict = {}
    for path in ("/v1/models", "/version"):
        try:
            r = httpx.get(base_url + path, timeout=10)
            if r.status_code == 200:
                info[path] = r.json()
        except (httpx.HTTPError, ValueError) as e:
            info[path] = {"error": f"{type(e).__name__}: {e}"}
    return info


def _versions() -> dict:
    out = {"python": sys.version.split()[0], "platform": platform.platform()}
    for dist in ("pdserve", "aiohttp", "httpx", "numpy", "tokenizers"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _first_model(server: dict) -> str | None:
    data = server.get("/v1/models", {}).get("data") or []
    return data[0].get("id") if data and isinstance(data[0], dict) else None


def run_bench(args: argparse.Namespace) -> dict:
    slos = parse_goodput(args.goodput)
    base = args.base_url.rstrip("/")
    server = _server_info(base)
    cfg = EndpointConfig(
        base_url=base,
        endpoint=args.endpoint,
        model=args.model or _first_model(server),
        ignore_eos=not args.no_ignore_eos,
        timeout_s=args.request_timeout,
        extra_body=args.extra_body,
    )
    tok = resolve_tokenizer(args.tokenizer)
    metrics_urls = args.metrics_url if args.metrics_url is not None else [base + "/metrics"]
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
              if k not in ("func", "bench_command", "command")}  # fmt: skip
    config.update(model=cfg.model, metrics_url=metrics_urls,
                  tokenizer_file=tok.path if tok else None)  # fmt: skip
    report = {
        "label": args.label or f"{cfg.model} @ {base}",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "versions": _versions(),
        "server": server,
        "runs": [],
    }
    for i, rate in enumerate(args.request_rate):
        # each rate its own prompts: the same ones again would be prefix-cache hits on a
        # server that caches (a 128-token prompt's TTFT fell from ~200 to ~57 ms that way)
        seed = args.seed + i
        run = asyncio.run(
            run_level(
                cfg, build_requests(args, cfg.is_chat, seed, tok), rate,
                burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                seed=seed, percentiles=args.percentiles, slos=slos,
                metrics_urls=metrics_urls, tok=tok, progress=not args.no_progress,
            )
        )  # fmt: skip
        run["dataset_seed"] = seed
        report["runs"].append(run)
        print(format_summary(run), flush=True)
    return report


def run(args: argparse.Namespace) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        report = run_bench(args)
    except (DatasetError, ValueError) as e:
        raise SystemExit(f"pdserve bench serve: {e}") from None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(json_safe(report), indent=1))
    written = [str(args.out)]
    if not args.no_plots:
        from pdserve.bench.plots import plot_serve

        written += [str(p) for p in plot_serve(report, args.out.with_suffix(""))]
    logger.info("wrote %s", ", ".join(written))


def json_safe(o):
    """Strict JSON: non-finite floats (rate inf) become strings, paths strings."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {str(k): json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    if isinstance(o, Path):
        return str(o)
    return o
