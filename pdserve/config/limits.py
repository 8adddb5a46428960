"""What one request may cost a node (pdserve/common/request_cost.py): the same three
limits on the router and on every node, declared here once."""

from __future__ import annotations

from pdserve.common.request_cost import CostLimits
from pdserve.config.fields import Settings, setting


class RequestCostSettings(Settings):
    """Per-request cost limits; a request over one gets HTTP 400 naming it."""

    max_sequences_per_request: int = setting(
        256, "engine sequences one request may ask for: prompts x n", ge=1
    )
    max_sequence_tokens_per_request: int = setting(
        1 << 20, "prompt tokens over all of a request's sequences: prompt tokens x n", ge=1
    )
    max_logprob_entries_per_request: int = setting(
        1 << 20,
        "logprob entries one request may ask for: sequences x (echoed prompt tokens + "
        "max_tokens) x (logprobs + 1)",
        ge=1,
    )

    @property
    def cost_limits(self) -> CostLimits:
        return CostLimits.of(self)
