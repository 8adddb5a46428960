"""Server-side counters before and after a run, read from Prometheus `/metrics` pages.

Every sample of a `counter` family is kept (labels in the key, as Prometheus writes
them), so this works on pdserve (`pdserve_prefix_cache_hits`, `pdserve_pd_remote_prefills`,
`pdserve_kv_received_bytes`, ...), vLLM and SGLang alike. An unreachable page is recorded
as an error string, never fails the benchmark.
"""

from __future__ import annotations

import aiohttp


def parse_counters(text: str) -> dict[str, float]:
    """Samples of the counter families in a Prometheus text page."""
    counters: set[str] = set()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4 and parts[3] == "counter":
                counters.add(parts[2])
            continue
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        base = name_part.split("{", 1)[0]
        family = base.removesuffix("_total")
        if base.endswith("_created") or (base not in counters and family not in counters):
            continue
        try:
            out[name_part] = float(value)
        except ValueError:
            continue
    return out


async def scrape(client: aiohttp.ClientSession, urls: list[str]) -> dict[str, dict]:
    """url -> {counter: value} (or {"error": message})."""
    out: dict[str, dict] = {}
    for url in urls:
        try:
            async with client.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
                r.raise_for_status()
                out[url] = parse_counters(await r.text())
        except (aiohttp.ClientError, OSError) as e:  # TimeoutError is an OSError
            out[url] = {"error": f"{type(e).__name__}: {e}"}
    return out


def delta(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per url, after - before for every counter that moved."""
    out: dict[str, dict] = {}
    for url, a in after.items():
        b = before.get(url, {})
        if "error" in a or "error" in b:
            out[url] = {"error": a.get("error") or b.get("error")}
            continue
        out[url] = {k: v - b.get(k, 0.0) for k, v in a.items() if v != b.get(k, 0.0)}
    return out
