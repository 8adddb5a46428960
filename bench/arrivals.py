"""When each request is sent: an open-loop schedule of start offsets (seconds).

Inter-arrival gaps are gamma-distributed with shape `burstiness` and mean `1 / rate`:
burstiness 1 is a Poisson process, below 1 burstier, above 1 more regular. Rate `inf`
sends everything at once (then only `--max-concurrency` limits the load).
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request rate {rate} must be > 0 (or inf)")
    if burstiness <= 0:
        raise ValueError(f"burstiness {burstiness} must be > 0")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request goes out at once
    return np.cumsum(gaps).tolist()
