"""Engine logprobs -> the OpenAI response shapes (completions' parallel lists, chat's
per-token objects). Token strings come from the tokenizer, one token at a time."""

from __future__ import annotations

from pdserve.api.protocol import ChatLogprobs, ChatLogprobToken, CompletionLogprobs, TopLogprob
from pdserve.engine.outputs import TokenLogprobs


class LogprobsFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def completion(
        self,
        token_ids: list[int],
        logprobs: list[float | None],
        top: list[TokenLogprobs | None] | None,
        offset: int,
    ) -> CompletionLogprobs:
        """`top` entries hold the token itself first, then its alternatives; the dict of
        each position has the token and its alternatives (vLLM's shape)."""
        tokens = [self.token_str(t) for t in token_ids]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        tops = None
        if top is not None:
            tops = [
                None
                if e is None
                else {self.token_str(t): lp for t, lp in zip(e.token_ids, e.logprobs)}
                for e in top
            ]
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=logprobs, top_logprobs=tops, text_offset=offsets
        )

    def chat(
        self, token_ids: list[int], logprobs: list[float], top: list[TokenLogprobs] | None
    ) -> ChatLogprobs:
        content = []
        for j, (t, lp) in enumerate(zip(token_ids, logprobs, strict=True)):
            s = self.token_str(t)
            alts = []
            if top is not None:
                e = top[j]
                alts = [
                    TopLogprob(token=(a := self.token_str(i)), logprob=v, bytes=list(a.encode()))
                    for i, v in zip(e.token_ids[1:], e.logprobs[1:])
                ]
            content.append(
                ChatLogprobToken(token=s, logprob=lp, bytes=list(s.encode()), top_logprobs=alts)
            )
        return ChatLogprobs(content=content)
