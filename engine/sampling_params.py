"""Per-request sampling parameters, validated at construction (the client boundary).

Every field a client can set has one rule in `pdserve/common/sampling_rules.py` (`FIELD_RULES`):
numbers must be finite and in range, integers must fit the wire types. A value outside its
rule raises `InvalidRequestError` naming the field, so it becomes a 400 at the HTTP
frontend and never reaches the engine thread. The rules live in `api/` so the router
applies the same ones. To add a sampling field: add it here and give it a rule there.
"""

from __future__ import annotations

import msgspec

from pdserve.common.sampling_rules import check_sampling_values

# Below this temperature sampling is greedy: dividing logits by it would overflow.
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick each next token, and when to stop.

    `temperature` below `GREEDY_TEMPERATURE` (0 included) is greedy. `top_k=None`,
    `top_p=1.0` and `min_p=0.0` disable their filters. `seed` makes one request's sampling
    reproducible regardless of its batch: each token's draw is seeded from (seed, its
    position), so a run resumed from a generated prefix continues it exactly. `logprobs=True` returns the log-probability of
    each sampled token (from the raw logits), with the `top_logprobs` most likely
    alternatives. `prompt_logprobs=k` (not None) returns each prompt token's logprob and
    its top k, computed in the prompt's own forward pass. `stop` strings are applied to
    the detokenized text by the frontend.

    Logits processing, in this order, before temperature and the filters:
    `repetition_penalty` (transformers' semantics: over prompt and output tokens, a
    positive logit is divided by it, a negative one multiplied), `frequency_penalty` and
    `presence_penalty` (OpenAI's: over output tokens, minus count * frequency minus
    presence if seen), `logit_bias` (token id -> added value), `min_tokens` (EOS and
    `stop_token_ids` barred until that many tokens exist), and `grammar` (an llguidance
    grammar: tokens it does not allow are barred).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    stop: list[str] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    min_tokens: int = 0
    grammar: str | None = None
    # prefix-cache tenant: blocks hash from a root keyed by it (pdserve/common/block_hash.py),
    # so only requests with the same salt hit them, in the shared store too (its chunk keys)
    cache_salt: str = ""
    # a migrated request's continuation (node/resume.py): the prompt's last
    # `resumed_tokens` tokens are output already streamed (penalties and grammars see them)
    resumed_tokens: int = 0

    def __post_init__(self) -> None:
        check_sampling_values({name: getattr(self, name) for name in self.__struct_fields__})

    @property
    def processes_logits(self) -> bool:
        """True when any logits processor applies (the sampler's slow path)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.grammar is not None
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def torch_seed(self) -> int | None:
        """`seed` as torch's unsigned 64-bit generator seed (negative seeds wrap)."""
        return None if self.seed is None else self.seed % 2**64
