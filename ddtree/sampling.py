"""The target's choice at each tree node: argmax at T = 0, else one sample from the processed
distribution (temperature, then top-k, then top-p). Sampling an independent token at every node
and walking keeps DDTree lossless: the path's tokens are distributed exactly as plain sampling."""
from __future__ import annotations

import torch

from ddtree.config import SamplingParams


def processed_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits [N, V] -> probabilities [N, V] after temperature, top-k and top-p (ties at the k-th
    logit are all kept; top-p keeps the smallest sorted prefix whose mass reaches p)."""
    scores = logits.float() / temperature
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [N, V], by the exponential race (argmax p / E, E ~ Exp(1))."""
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return torch.argmax(probs / noise, dim=-1)


def choose_tokens(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [N, V] -> the target's token at each of the N rows, [N] long."""
    if params.greedy:
        return torch.argmax(logits, dim=-1)
    probs = processed_probs(logits, params.temperature, params.top_k, params.top_p)
    return sample_from(probs, generator)
