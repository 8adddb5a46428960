"""A request as the engine core tracks it: tokens, progress, status and block hashes."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

from pdserve.common.block_hash import hash_block_tokens, root_hash
from pdserve.engine.outputs import TokenLogprobs
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.grammar import Grammar


_MASK64 = 2**64 - 1


def _mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection on 64-bit ints that scatters nearby inputs."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the token at `position` (index in prompt + output) of a
    request seeded with `seed` (unsigned 64-bit). Seeds s and s + 1 (choices of `n`) at
    neighbouring positions get unrelated streams."""
    return _mix64((seed ^ _mix64(position + 0x9E3779B97F4A7C15)) & _MASK64)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks held, a prefill node fills them
    WAITING_FOR_STORE = "waiting_for_store"  # blocks held, the KV store loads a prefix into them
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort", "error")


class Request:
    """One sequence. `num_computed_tokens` catches up with `num_tokens` step by step.

    Invariant: `block_hashes[i]` is the chained hash of tokens `[i*bs, (i+1)*bs)` of
    `all_token_ids`, for every block that is full.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        block_size: int,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float | None = None,
        remote_prefill: str | None = None,
        hash_root: bytes | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        # Time-to-first-token stages (engine clock, time.monotonic); see RequestTimings.
        self.first_scheduled_time: float | None = None
        self.kv_order_time: float | None = None  # PD decode: prefill order sent
        self.kv_done_time: float | None = None  # PD decode: every KV block landed
        self.prefill_node_s: tuple[float, float] | None = None  # PD: its queue, compute
        # PD decode: why it was prefilled here after all (`local_transfer_failed`,
        # `local_checksum_mismatch`; None: it was not, or never asked a prefill node)
        self.prefill_fallback: str | None = None
        self.timings_sent = False
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[TokenLogprobs] = []
        # prompt_logprobs[j]: prompt token j + 1 (filled as the prompt is computed)
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs_sent = False
        # Structured output: the grammar state (engine.grammar.Grammar), set by the core.
        self.grammar: Grammar | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at first scheduling
        self.status = RequestStatus.WAITING
        # PD: the prefill node to compute this prompt's KV (None: compute it here).
        self.remote_prefill = remote_prefill
        # PD: a prefill order from another node. It yields no output for this node's
        # clients, and its blocks are held after it finishes until the export has ended.
        self.kv_export = False
        # PD: which transfer attempt fills (decode) or reads (prefill) this request's
        # blocks; holds are keyed by (request id, attempt), so a retry never meets its
        # earlier attempt's blocks.
        self.attempt = 0
        self.error: str | None = None
        # Chain root of the block hashes (pdserve/common/block_hash.py: keyed by model and block size).
        self.hash_root = hash_root if hash_root is not None else root_hash("", block_size)
        # KV store (engine/kv_store.py): looked up once; prompt saved once; prompt tokens it
        # holds; tokens [0, store_saved_upto) handed to a save (whole chunks, generated too)
        self.store_checked = False
        self.store_saved = False
        self.store_tokens = 0
        self.store_saved_upto = 0
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()
        self._generator: torch.Generator | None = None
        self.processes_logits = sampling_params.processes_logits

    @property
    def prefill_path(self) -> str:
        """Where its prompt was prefilled and why (`outputs.PREFILL_PATHS`)."""
        if self.kv_done_time is not None:
            return "remote"
        if self.prefill_fallback is not None:
            return self.prefill_fallback
        return "store_hit" if self.store_tokens else "local_policy"

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet (positions 0 .. P-2)."""
        return (
            self.sampling_params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The generator for the token at position `num_tokens`, seeded from (seed, that
        position); None if no seed is set.

        The random stream is a function of the seed and the token's position, never of
        how many steps this request has taken: a request resumed from its prompt plus a
        generated prefix (router migration) draws the same token at each position as the
        run it continues. One generator per request, re-seeded per draw, on the logits'
        device (`torch.multinomial` on CUDA probabilities rejects a CPU generator).
        """
        seed = self.sampling_params.torch_seed
        if seed is None:
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
        return self._generator.manual_seed(position_seed(seed, self.num_tokens))

    @property
    def generated_token_ids(self) -> list[int]:
        """Every output token, those of a resumed request's earlier run included."""
        k = self.sampling_params.resumed_tokens
        if not k:
            return self.output_token_ids
        return self.all_token_ids[self.num_prompt_tokens - k :]

    def set_grammar(self, grammar: Grammar) -> None:
        """Attach the grammar state, replaying a resumed request's earlier output into it."""
        k = self.sampling_params.resumed_tokens
        for token in self.prompt_token_ids[len(self.prompt_token_ids) - k :] if k else ():
            grammar.accept(token)
        self.grammar = grammar

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(
        self, token_id: int, logprob: float | None = None, top: TokenLogprobs | None = None
    ) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)
        self._update_block_hashes()

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the newest token implies, or None to keep going."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if not params.ignore_eos and last in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= params.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _update_block_hashes(self) -> None:
        bs = self.block_size
        while (len(self.block_hashes) + 1) * bs <= len(self.all_token_ids):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else self.hash_root
            self.block_hashes.append(
                hash_block_tokens(parent, self.all_token_ids[i * bs : (i + 1) * bs])
            )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
