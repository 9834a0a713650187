"""A request's log-probs (ddtree.logprobs.TokenLogprob) in OpenAI's two shapes.

completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}, where
each top_logprobs entry holds the `logprobs` most likely tokens and the emitted one, as OpenAI does;
chat: {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}.
A stream's chunks carry the log-probs of their own tokens; text offsets continue across chunks.
"""
from __future__ import annotations

from typing import Callable

from ddtree.logprobs import TokenLogprob


class LogprobsFormatter:
    def __init__(self, token_text: Callable[[int], str]):
        self.token_text = token_text
        self.offset = 0  # characters of the tokens' texts so far: the next token's text_offset

    def completion(self, logprobs: list[TokenLogprob]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob)
            top = {self.token_text(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, logprobs: list[TokenLogprob]) -> dict:
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]} for lp in logprobs]}
