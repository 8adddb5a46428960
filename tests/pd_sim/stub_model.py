"""A stub model for the PD simulation: known KV bytes, deterministic tokens, checked reads.

The KV of position p is a chained hash of tokens 0..p (`kv_value`), written into every
element of that slot (K = h, V = h + 1). Before each step the runner checks that every
position a row attends over holds exactly that value: a request never computes on KV
that differs from what its prefix really is (a block reused under a WRITE, a garbage
WRITE, an incomplete transfer all show up here). The sampled token is a function of the
last position's hash, so prefill and decode nodes agree on every token.
"""

from __future__ import annotations

import numpy as np
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_arch import ModelArch
from pdserve.engine.sampler import Sampled

VOCAB = 512
EOS = 2
_MOD = 1 << 22  # exact in float32


class KVMismatch(AssertionError):
    pass


def kv_values(tokens: list[int]) -> list[int]:
    out, h = [], 17
    for t in tokens:
        h = (h * 1009 + t + 1) % _MOD
        out.append(h)
    return out


def next_token(h: int) -> int:
    return 3 + h % (VOCAB - 3)  # never EOS: requests end by max_tokens


def expected_output(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(kv_values(tokens)[-1]))
    return tokens[len(prompt) :]


def stub_arch() -> ModelArch:
    return ModelArch.from_dict(
        dict(
            vocab_size=VOCAB,
            hidden_size=8,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=1,
            max_position_embeddings=4096,
            eos_token_id=EOS,
        )
    )


class StubRunner:
    def __init__(self, config: EngineConfig, arch: ModelArch, model_dir: str, num_blocks: int):
        self.block_size = config.cache.block_size
        self.kv_cache = torch.zeros((1, 2, num_blocks, self.block_size, 1, 1))
        self.node = model_dir
        self.on_execute = None  # the simulator lets time pass here (a long step)

    def execute(self, sched, block_ids):
        if self.on_execute is not None:
            self.on_execute()
        bs = self.block_size
        sampled = {}
        kv = self.kv_cache.numpy()[0, :, :, :, 0, 0]  # [2 (K, V), blocks, bs]
        for s in sched.scheduled:
            req = s.request
            table = np.asarray(block_ids[req.request_id])
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_new_tokens
            values = np.asarray(kv_values(req.all_token_ids[:end]), dtype=np.float32)
            pos = np.arange(end)
            blocks, offs = table[pos // bs], pos % bs
            # what this step attends over must be the request's true prefix
            bad = np.nonzero(kv[0, blocks[:start], offs[:start]] != values[:start])[0]
            if bad.size:
                p = int(bad[0])
                raise KVMismatch(
                    f"{self.node}: request {req.request_id} position {p} in block "
                    f"{blocks[p]} holds {kv[0, blocks[p], offs[p]]}, expected {values[p]}"
                )
            kv[0, blocks[start:], offs[start:]] = values[start:]
            kv[1, blocks[start:], offs[start:]] = values[start:] + 1
            if s.samples:
                sampled[req.request_id] = Sampled(next_token(int(values[-1])))
        return sampled, {}

    def wait_step_done(self) -> None:
        pass  # the stub's writes are done when execute() returns (as on CPU)
