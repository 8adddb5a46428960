"""Run one load level against an endpoint: schedule, send, gather, summarize.

Open loop: request i is sent at its arrival offset whether or not earlier ones have
finished; `max_concurrency` (if set) caps the requests in flight, so later ones wait for
a slot (their latency is measured from when they are actually sent). One shared
`aiohttp.ClientSession` with no connection limit carries every request (about half the
CPU per streamed chunk of httpx's client: the benchmark shares the box with the server
it measures).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict

import aiohttp
from tqdm import tqdm

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import EndpointConfig, RequestRecord, send_request
from pdserve.bench.counters import delta, scrape
from pdserve.bench.datasets import BenchRequest, Tokenizer
from pdserve.bench.metrics import SLO, summarize

logger = logging.getLogger(__name__)


async def run_level(
    cfg: EndpointConfig,
    requests: list[BenchRequest],
    rate: float,
    *,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    seed: int = 0,
    percentiles: list[float],
    slos: list[SLO] | None = None,
    metrics_urls: list[str] = (),
    tok: Tokenizer | None = None,
    progress: bool = True,
) -> dict:
    """One run at `rate` req/s: its metrics, server counters and per-request records."""
    offsets = arrival_offsets(len(requests), rate, burstiness, seed)
    connector = aiohttp.TCPConnector(limit=0)  # no connection limit
    timeout = aiohttp.ClientTimeout(total=None, sock_read=cfg.timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        before = await scrape(client, list(metrics_urls))
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc=f"rate {rate:g}", unit="req", disable=not progress)
        t0 = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                rec = await send_request(client, cfg, requests[i], i, t0, tok)
            else:
                async with sem:
                    rec = await send_request(client, cfg, requests[i], i, t0, tok)
            bar.update()
            if not rec.ok:
                logger.debug("request %d failed (%s): %s", i, rec.error_kind, rec.error)
            return rec

        records = await asyncio.gather(*(one(i) for i in range(len(requests))))
        bar.close()
        after = await scrape(client, list(metrics_urls))
    metrics = summarize(list(records), percentiles, slos)
    return {
        "request_rate": rate,
        "burstiness": burstiness,
        "max_concurrency": max_concurrency,
        "metrics": metrics,
        "server_counters": {"before": before, "after": after, "delta": delta(before, after)},
        "requests": [_record_json(r) for r in records],
    }


def _record_json(r: RequestRecord) -> dict:
    d = asdict(r)
    d["tpot"] = r.tpot
    return d
