"""The shape of a round's draft tree, the value behind every tree budget.

- `AR`: plain autoregressive decoding: one node (the root), the drafter is never called;
- `CHAIN`: DFlash's linear draft, the block's b - 1 argmax tokens after the root;
- `TreeShape.best(B)`: the best B prefixes of the drafter's block, grown best-first.

Shapes are immutable and hashable: the engine keys its buffers and graphs by them. Text, numbers and
JSON become shapes in `ddtree.config.parse_tree_budget`; `label` and `json_value` are the way back.
"""
from __future__ import annotations

from dataclasses import dataclass

_AR, _CHAIN, _BEST = "ar", "chain", "best"


@dataclass(frozen=True)
class TreeShape:
    kind: str  # "ar", "chain" or "best"
    budget: int = 0  # "best" only: nodes drafted past the root (>= 1); 0 otherwise

    def __post_init__(self) -> None:
        if self.kind not in (_AR, _CHAIN, _BEST) or (self.kind == _BEST) != (self.budget >= 1):
            raise ValueError(f"not a tree shape: kind={self.kind!r}, budget={self.budget!r}")

    @classmethod
    def best(cls, budget: int) -> TreeShape:
        return cls(_BEST, budget)

    @property
    def label(self) -> str:
        """"ar", "chain" or the budget's digits: what logs, statistics and metrics show."""
        return str(self.budget) if self.kind == _BEST else self.kind

    def __str__(self) -> str:
        return self.label

    @property
    def json_value(self) -> str | int:
        """"ar", "chain" or the budget as an integer: what result and tune files hold."""
        return self.budget if self.kind == _BEST else self.kind

    @property
    def drafts(self) -> bool:
        """Whether a round runs the drafter (everything but "ar")."""
        return self.kind != _AR

    @property
    def single_node(self) -> bool:
        """Whether the round verifies the root alone ("ar"): nothing to walk or move."""
        return self.kind == _AR

    @property
    def builds_tree(self) -> bool:
        """Whether each round grows a tree from the drafter's logits; a chain's shape never changes."""
        return self.kind == _BEST

    def nodes(self, block_size: int) -> int:
        """Nodes verified per round, root included."""
        return {_AR: 1, _CHAIN: block_size}.get(self.kind, self.budget + 1)

    def drafted_tokens(self, block_size: int, vocab_size: int) -> int:
        """Nodes (root excluded) the drafter proposes per round: 0 for "ar", b - 1 for "chain", else
        the budget, capped by the number of distinct prefixes a block of b - 1 tokens allows."""
        depth = max(block_size - 1, 0)
        return {_AR: 0, _CHAIN: depth}.get(self.kind, min(self.budget, depth * vocab_size))


AR = TreeShape(_AR)
CHAIN = TreeShape(_CHAIN)

# The budgets ddtree picks by itself (the default, the server's candidates, `ddtree tune`'s and
# `ddtree bench`'s sweeps) are 2^k - 1. A budget B verifies B + 1 tokens, the root included, so
# 2^k - 1 fills whole tiles of the verify's matmuls and attention where 2^k leaves one token past
# them, and the node that 2^k adds is the tree's least likely. H200, ms a round (round_latency.py):
# Qwen3.6-27B shape at 8192 tokens 15 / 16 18.76 / 19.00, 63 / 64 20.54 / 21.10, 255 / 256
# 33.90 / 36.43; Qwen3-8B shape at 32768 tokens 63 / 64 9.61 / 10.56, 255 / 256 20.72 / 22.62
# (results/round_latency_h200_{qwen36_27b_8k,qwen3_8b_32k}_pow2_nodes.json), and with the later
# attention kernels 7.27 / 7.93 ms of verify at 63 / 64 (verify_profile_h200_qwen3_8b_32k_63_64.json).
# Acceptance on the demo pair (greedy, 24 prompts): 4.00 at 15 against 4.02 at 16, 4.75 at both 63
# and 64 (bench_cpu_demo_acceptance_15_16_63_64.json). Any budget can still be asked for by number.
DEFAULT_BEST = 63  # the default tree budget of a pair with a drafter
SMALL_BEST = 15  # the server's smaller candidate tree
SWEEP_BEST = (15, 31, 63, 127, 255, 511, 1023)  # tune's calibration and bench's default sweep
DEFAULT_TREE_BUDGET = TreeShape.best(DEFAULT_BEST)


def shape_json(value: object) -> object:
    """`json.dumps(..., default=shape_json)`: a shape is written as its `json_value`."""
    if isinstance(value, TreeShape):
        return value.json_value
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")
