"""The target's log-probabilities of the tokens a request emits, and their top alternatives.

They are the raw distribution's (the target's logits before temperature, top-k or top-p, as
vLLM's default "raw_logprobs"), at the position of each emitted token: a round's emitted tokens are
the target's choices at its accepted nodes, whose logits the verify already computed, so the values
are exact at every tree budget. They are gathered on the device inside the round and copied to the
host with its summary (no extra host sync), only for requests that ask for them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20  # top alternatives a request may ask for (OpenAI's limit)


@dataclass
class TokenLogprob:
    """An emitted token's log-probability and the `k` most likely tokens at its position, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def chosen_logprobs(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """logits [R, V] and the chosen token of each row [R] -> (log-prob of the chosen [R], top-k
    log-probs [R, k], their ids [R, k]), float32 on the device."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values = logp.gather(1, chosen.reshape(-1, 1)).reshape(-1)
    top = torch.topk(logp, k, dim=-1) if k > 0 else None
    if top is None:
        return values, logp.new_zeros(logp.shape[0], 0), chosen.new_zeros(logp.shape[0], 0)
    return values, top.values, top.indices


def as_token_logprobs(token_ids: list[int], values: list[float], top_values: list[list[float]],
                      top_ids: list[list[int]]) -> list[TokenLogprob]:
    return [TokenLogprob(t, v, list(zip(ids, vals))) for t, v, vals, ids in zip(token_ids, values, top_values, top_ids)]


class RoundLogprobs:
    """A budget's device buffers for one round's log-probs (a row per kept node) and two host copies,
    copied with the round's summary and read after the same sync."""

    def __init__(self, keep: int, device):
        cuda = torch.device(device).type == "cuda"
        self.values = torch.zeros(keep, dtype=torch.float32, device=device)
        self.top_values = torch.zeros(keep, MAX_LOGPROBS, dtype=torch.float32, device=device)
        self.top_ids = torch.zeros(keep, MAX_LOGPROBS, dtype=torch.long, device=device)
        self.host = [tuple(torch.zeros_like(t, device="cpu").pin_memory() if cuda else torch.zeros_like(t, device="cpu")
                           for t in (self.values, self.top_values, self.top_ids)) for _ in range(2)]

    def gather(self, logits: torch.Tensor, rows: torch.Tensor, chosen: torch.Tensor, k: int, index: int) -> None:
        """Log-probs of `chosen` at logits' `rows`, into host copy `index` (asynchronously)."""
        values, top_values, top_ids = chosen_logprobs(logits.index_select(0, rows), chosen, k)
        self.values.copy_(values)
        self.top_values[:, :k].copy_(top_values)
        self.top_ids[:, :k].copy_(top_ids)
        for host, device in zip(self.host[index], (self.values, self.top_values, self.top_ids)):
            host.copy_(device, non_blocking=True)

    def read(self, index: int, token_ids: list[int], k: int) -> list[TokenLogprob]:
        """The first len(token_ids) rows of host copy `index` (after the round's sync)."""
        n = len(token_ids)
        values, top_values, top_ids = self.host[index]
        return as_token_logprobs(token_ids, values[:n].tolist(), top_values[:n, :k].tolist(), top_ids[:n, :k].tolist())
