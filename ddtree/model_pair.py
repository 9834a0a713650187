"""Which target + drafter pair to load, and the checks that need only their config.json files.

The demo drafter was trained for the demo target alone. Paired with any other target it would
either be refused (another shape) or, worse, load and draft tokens that mean nothing to it, so
a target given without a drafter decodes plainly (tree budget `ar`), as a vLLM server does
without a speculative config, and says so in one line. No torch here: `ddtree serve` runs these
checks before it opens its port.
"""
from __future__ import annotations

from pathlib import Path

from ddtree.config import DDTreeError
from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.tree_shape import TreeShape

REPO_MODELS = Path(__file__).resolve().parent.parent / "models"
DEFAULT_TARGET = REPO_MODELS / "demo-target"
DEFAULT_DRAFT = REPO_MODELS / "demo-drafter"


def is_demo_target(target: str | Path | None) -> bool:
    return target is None or Path(target).resolve() == DEFAULT_TARGET.resolve()


def default_drafter(target: str | Path | None) -> Path | None:
    """The drafter to use when none is named: the demo drafter for the demo target, else none."""
    return DEFAULT_DRAFT if is_demo_target(target) else None


def no_drafter_warning(target: str | Path) -> str:
    return (f"no drafter given for target {target}: decoding without speculation (tree budget 'ar'); "
            f"name a DFlash drafter (--draft DIR) to use DDTree")


def needs_drafter_error(budget: TreeShape) -> DDTreeError:
    return DDTreeError(f"tree budget {budget} needs a drafter: pass --draft DIR (the demo drafter only pairs with "
                       f"the demo target), or use tree budget 'ar'", "tree_budget")


def context_limit(target: TargetConfig, max_model_len: int | None) -> int:
    """The context limit: `max_model_len` when given (checked against the target's), else the
    target's (max_position_embeddings, extended by its rope scaling: `TransformerConfig.context_limit`)."""
    limit = target.context_limit
    if max_model_len is None:
        return limit
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not 2 <= max_model_len <= limit:
        raise DDTreeError(f"max_model_len must be an integer in [2, {limit}] for this target, got {max_model_len!r}",
                          "max_model_len")
    return max_model_len


def check_pair_configs(target: str | Path | None, draft: str | Path | None, max_model_len: int | None = None,
                       rope_scaling: dict | None = None) -> None:
    """Everything about a pair that its config.json files decide (the files exist and parse, the
    drafter fits the target, the context limit fits), in milliseconds and before any weight loads.
    rope_scaling: over the target's rope settings (`--rope-scaling`)."""
    target_cfg = TargetConfig.from_dir(target if target is not None else DEFAULT_TARGET, rope_scaling)
    context_limit(target_cfg, max_model_len)
    if draft is not None:
        DrafterConfig.from_dir(draft).check_against(target_cfg, draft)


def check_budget_has_drafter(budget: TreeShape | str | None, target: str | Path | None, draft: str | Path | None) -> None:
    """Refuse a tree budget other than `ar` (or auto, the string) when no drafter will be loaded."""
    if draft is None and default_drafter(target) is None and isinstance(budget, TreeShape) and budget.drafts:
        raise needs_drafter_error(budget)
