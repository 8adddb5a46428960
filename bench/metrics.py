"""Serving metrics from request records: latency statistics, throughput, goodput, failures.

Definitions (those of vLLM's and SGLang's serving benchmarks, so numbers compare):
- TTFT: request sent -> first content chunk received.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests with < 2 tokens have none.
- ITL: gaps between consecutive content chunks, pooled over all requests.
- E2E: request sent -> last event (`[DONE]`).
- Throughput: completed requests, prompt tokens, output tokens per second of the run's
  duration (first request sent -> last request ended).
- Goodput: completed requests per second that met every SLO given (`ttft`, `tpot`, `e2el`,
  milliseconds).
Percentiles are numpy's linear interpolation.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import numpy as np

from pdserve.bench.client import RequestRecord

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class SLO:
    metric: str  # ttft | tpot | e2el
    ms: float


def parse_goodput(items: list[str]) -> list[SLO]:
    """`["ttft:500", "tpot:100"]` -> SLOs; ValueError naming the bad item."""
    slos = []
    for item in items:
        name, _, value = item.partition(":")
        if name not in SLO_METRICS:
            raise ValueError(f"goodput {item!r}: metric must be one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput {item!r}: expected METRIC:MILLISECONDS") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"goodput {item!r}: the limit must be a positive number of ms")
        slos.append(SLO(name, ms))
    return slos


def latency_stats(values_s: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """mean/median/std/min/max and pXX of `values_s`, in milliseconds (None when empty)."""
    keys = ["mean", "median", "std", "min", "max"] + [_pkey(p) for p in percentiles]
    if not values_s:
        return dict.fromkeys(keys)
    a = np.asarray(values_s, dtype=float) * 1e3
    out = {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "std": float(a.std()),
        "min": float(a.min()),
        "max": float(a.max()),
    }
    for p in percentiles:
        out[_pkey(p)] = float(np.percentile(a, p))
    return out


def _pkey(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def meets(rec: RequestRecord, slos: list[SLO]) -> bool:
    values = {"ttft": rec.ttft, "tpot": rec.tpot, "e2el": rec.e2e}
    for slo in slos:
        v = values[slo.metric]
        if slo.metric == "tpot" and v is None and rec.ok:
            continue  # one output token: no TPOT to violate
        if v is None or v * 1e3 > slo.ms:
            return False
    return True


def summarize(
    records: list[RequestRecord], percentiles: list[float], slos: list[SLO] | None = None
) -> dict:
    """Every metric of one run (one request rate)."""
    ok = [r for r in records if r.ok]
    bad = [r for r in records if not r.ok]
    if records:
        t_begin = min(r.start for r in records)
        t_end = max(r.start + (r.e2e or 0.0) for r in records)
        duration = max(t_end - t_begin, 1e-9)
    else:
        duration = 0.0

    def per_s(x: float) -> float:
        return x / duration if duration else 0.0

    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.output_tokens for r in ok)
    latencies = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itls],
        "e2el": [r.e2e for r in ok if r.e2e is not None],
    }
    out = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(bad),
        "failure_reasons": dict(Counter(r.error_kind for r in bad)),
        "failure_examples": _examples(bad),
        "duration_s": duration,
        "total_input_tokens": in_tok,
        "total_output_tokens": out_tok,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(in_tok),
        "output_throughput": per_s(out_tok),
        "total_token_throughput": per_s(in_tok + out_tok),
        "max_concurrent_requests": _max_concurrency(records),
    }
    for name in LATENCIES:
        out[f"{name}_ms"] = latency_stats(latencies[name], percentiles)
    if slos:
        good = sum(1 for r in ok if meets(r, slos))
        out["goodput"] = {
            "slos_ms": {s.metric: s.ms for s in slos},
            "good_requests": good,
            "request_goodput": per_s(good),
        }
    stages = stage_breakdown(ok)
    if stages:
        out["ttft_stages_ms"] = stages
    return out


def _examples(bad: list[RequestRecord]) -> dict[str, str]:
    seen: dict[str, str] = {}
    for r in bad:
        seen.setdefault(r.error_kind or "other", r.error or "")
    return seen


def _max_concurrency(records: list[RequestRecord]) -> int:
    events = []
    for r in records:
        events.append((r.start, 1))
        events.append((r.start + (r.e2e or 0.0), -1))
    level = peak = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        level += d
        peak = max(peak, level)
    return peak


def stage_breakdown(ok: list[RequestRecord]) -> dict[str, dict[str, float]]:
    """Mean and median of each server-reported TTFT stage (ms), over requests reporting it.

    `client_overhead` is the client's TTFT minus the server's: network, HTTP and SSE.
    """
    per_stage: dict[str, list[float]] = {}
    for r in ok:
        t = r.server_timings
        if not t or not isinstance(t.get("stages"), dict):
            continue
        for name, v in t["stages"].items():
            if isinstance(v, (int, float)):
                per_stage.setdefault(name, []).append(float(v))
        server_ttft = t.get("ttft_s")
        if isinstance(server_ttft, (int, float)) and r.ttft is not None:
            router = t["stages"].get("router_wait", 0.0)
            per_stage.setdefault("client_overhead", []).append(r.ttft - server_ttft - router)
    return {
        name: {"mean": float(np.mean(v) * 1e3), "median": float(np.median(v) * 1e3), "n": len(v)}
        for name, v in per_stage.items()
    }
