"""Validated settings shared by the engine, the server, the benchmark and the CLI.

Every user-facing value is checked here, once, and a bad one raises
`DDTreeError` with a one-line message naming the problem.
"""
from __future__ import annotations

import math
import re
import reprlib
from dataclasses import dataclass, field

from ddtree.tree_shape import AR, CHAIN, TreeShape


class DDTreeError(ValueError):
    """A user-facing error: bad input, a bad file, a mismatched model pair.

    The CLI prints it as one line and exits non-zero; the server answers 400.
    `param` names the offending field when there is one.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


MAX_TREE_BUDGET = 4096
# Tokens per forward of a long prompt's prefill: bounds its activations and, in a batch, how long
# the running requests wait for a joining prompt (a chunk a round).
PREFILL_CHUNK = 4096
_DIGITS = re.compile(r"[0-9]{1,9}")  # more digits than this are over MAX_TREE_BUDGET anyway
GREEDY_BELOW = 1e-5


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxdict, _SHORT_REPR.maxlist, _SHORT_REPR.maxtuple = 3, 4, 6, 6
_SHORT_REPR.maxstring, _SHORT_REPR.maxlong, _SHORT_REPR.maxother = 60, 40, 60


def shown(value: object, limit: int = 80) -> str:
    """repr(value) cut to about `limit` characters, without building the whole repr of a huge input:
    error messages never echo a megabyte back."""
    text = _SHORT_REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_tree_budget(value: object, *, allow_auto: bool = False) -> TreeShape | str:
    """A tree budget given as text, number or shape -> its TreeShape ("auto" stays the string "auto",
    accepted only with `allow_auto`)."""
    if isinstance(value, TreeShape):
        return value
    if isinstance(value, bool):
        raise DDTreeError(f"tree budget must be 'ar', 'chain' or an integer >= 1, got {shown(value)}", "tree_budget")
    if isinstance(value, int):
        budget = value
    elif isinstance(value, float) and value.is_integer():
        budget = int(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        if text in (AR.label, CHAIN.label):
            return TreeShape(text)
        if allow_auto and text == "auto":
            return text
        # Plain ASCII digits only: int() would also take "+5", "1_000" and other scripts' digits.
        if _DIGITS.fullmatch(text):
            budget = int(text)
        else:
            raise DDTreeError(
                f"tree budget must be 'ar', 'chain'{', auto' if allow_auto else ''} or an integer >= 1, got {shown(value)}",
                "tree_budget",
            )
    else:
        raise DDTreeError(f"tree budget must be 'ar', 'chain' or an integer >= 1, got {shown(value)}", "tree_budget")
    if budget < 1:
        raise DDTreeError(f"tree budget must be >= 1 (use 'ar' for no drafting), got {shown(budget)}", "tree_budget")
    if budget > MAX_TREE_BUDGET:
        raise DDTreeError(f"tree budget must be <= {MAX_TREE_BUDGET}, got {shown(budget)}", "tree_budget")
    return TreeShape.best(budget)


@dataclass
class SamplingParams:
    """Per-request decoding settings. `top_k = 0` and `top_p = 1` switch those filters off."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no log-probs; k: each emitted token's log-prob and the k most likely tokens (0..20).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 decode greedily (as vLLM does): dividing by them overflows."""
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        def number(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise DDTreeError(f"{name} must be a finite number, got {shown(value)}", name)
            return float(value)

        def integer(name: str, value: object) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise DDTreeError(f"{name} must be an integer, got {shown(value)}", name)
            return value

        if integer("max_tokens", self.max_tokens) < 1:
            raise DDTreeError(f"max_tokens must be >= 1, got {shown(self.max_tokens)}", "max_tokens")
        if number("temperature", self.temperature) < 0:
            raise DDTreeError(f"temperature must be >= 0, got {shown(self.temperature)}", "temperature")
        top_p = number("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise DDTreeError(f"top_p must be in (0, 1], got {shown(self.top_p)}", "top_p")
        if integer("top_k", self.top_k) < 0:
            raise DDTreeError(f"top_k must be >= 0 (0 disables it), got {shown(self.top_k)}", "top_k")
        if self.seed is not None and not 0 <= integer("seed", self.seed) < 2**63:
            raise DDTreeError(f"seed must be in [0, 2**63), got {shown(self.seed)}", "seed")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise DDTreeError("stop must be a non-empty string or a list of non-empty strings", "stop")
        self.stop = list(self.stop)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise DDTreeError("stop_token_ids must be a list of integers", "stop_token_ids")
        for token in self.stop_token_ids:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise DDTreeError(f"stop_token_ids must hold integers >= 0, got {shown(token)}", "stop_token_ids")
        self.stop_token_ids = list(self.stop_token_ids)
        if not isinstance(self.ignore_eos, bool):
            raise DDTreeError("ignore_eos must be true or false", "ignore_eos")
        if self.logprobs is not None and not 0 <= integer("logprobs", self.logprobs) <= 20:
            raise DDTreeError(f"logprobs must be in [0, 20], got {shown(self.logprobs)}", "logprobs")
