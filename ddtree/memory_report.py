"""`python -m ddtree.memory_plan`: a pair's memory plan as text, or the table of docs/memory.md.

    python -m ddtree.memory_plan --target models/demo-target --draft models/demo-drafter
    python -m ddtree.memory_plan --target qwen3.6-27b --free-gib 125.1
    python -m ddtree.memory_plan --table          # the pairs of docs/memory.md, as Markdown
"""
from __future__ import annotations

import argparse
from pathlib import Path

from ddtree.config import DDTreeError, parse_tree_budget
from ddtree.memory_plan import DTYPE_BYTES, GiB, KiB, MiB, PairMemory, target_kv_bytes_per_token, verify_logits_bytes
from ddtree.model_pair import DEFAULT_DRAFT, DEFAULT_TARGET, default_drafter
from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.models.known_shapes import NAMES, named_pair
from ddtree.tree_shape import AR, DEFAULT_TREE_BUDGET

H200_GIB = 139  # device memory of one H200 as torch reports it
USABLE = 0.90  # the rest is left for activations, graphs' temporaries, the CUDA context and the allocator
CONTEXTS = (8192, 32768, 131072)
TABLE_PAIRS = (("demo pair", str(DEFAULT_TARGET), str(DEFAULT_DRAFT)), ("Qwen3-8B + 5-layer DFlash", "qwen3-8b", None),
               ("Qwen3.6-27B + DFlash (4 sliding + 1 full)", "qwen3.6-27b", None))


def load_pair(target: str, draft: str | None) -> tuple[TargetConfig, DrafterConfig | None]:
    """Configs of a named shape (NAMES) or of checkpoint directories. A named target comes with
    its drafter; a directory with the demo drafter when it is the demo target. draft "none": no drafter."""
    if target in NAMES:
        target_cfg, drafter_cfg = named_pair(target)
        if draft is None or draft == target:
            return target_cfg, drafter_cfg
    else:
        target_cfg = TargetConfig.from_dir(target)
        if draft is None:
            default = default_drafter(target)
            draft = str(default) if default is not None else "none"
    if draft == "none":
        return target_cfg, None
    if draft in NAMES:
        return target_cfg, named_pair(draft)[1]
    drafter_cfg = DrafterConfig.from_dir(draft)
    drafter_cfg.check_against(target_cfg, draft)
    return target_cfg, drafter_cfg


def describe(pair: PairMemory, free_bytes: int, contexts=CONTEXTS) -> str:
    """The plan of one pair, line by line."""
    longest = pair.max_context_tokens(free_bytes)
    lines = [
        f"dtype {pair.dtype}, tree budget {pair.budget}, CUDA graphs {'on' if pair.graphs else 'off'} "
        f"(KV bucket {pair.kv_bucket}); {free_bytes / GiB:.1f} GiB for ddtree",
        f"weights: target {pair.target_weights / GiB:.3f} GiB, drafter {pair.drafter_weights / GiB:.3f} GiB "
        f"(fused context k/v copy included)",
        f"KV cache per token: {kv_split(pair)} KiB (target + drafter)",
        f"fixed per sequence (recurrent state + conv window): {pair.state_bytes / MiB:.2f} MiB",
        f"round buffers of budget {pair.budget}: {pair.round_bytes / MiB:.2f} MiB; verify logits buffer shared by its "
        f"front graphs: {verify_logits_bytes(pair.target, pair.nodes) / MiB if pair.graphs else 0:.2f} MiB",
        f"longest context: {longest} tokens (config limit {pair.target.context_limit})",
    ]
    for context in contexts:
        shared, each = pair.shared_bytes(context) / GiB, pair.sequence_bytes(context) / GiB
        lines.append(f"sequences of {context} tokens: {pair.max_sequences(free_bytes, context)} "
                     f"(shared {shared:.2f} GiB + {each:.3f} GiB each)")
    return "\n".join(lines)


def kv_split(pair: PairMemory) -> str:
    """KV KiB per token as target + drafter."""
    target = target_kv_bytes_per_token(pair.target, pair.dtype)
    return f"{target / KiB:.1f} + {(pair.kv_bytes_per_token - target) / KiB:.1f}"


def table(free_bytes: int, dtype: str, budget, graphs: bool) -> str:
    """The Markdown table of docs/memory.md."""
    heads = ["pair", "weights (GiB)", "KV per token (KiB)", "state per sequence (MiB)", "longest context (tokens)",
             "config limit", *(f"sequences of {c // 1024}k" for c in CONTEXTS)]
    rows = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for label, target, draft in TABLE_PAIRS:
        pair = PairMemory(*load_pair(target, draft), dtype=dtype, budget=budget, graphs=graphs)
        cells = [label, f"{pair.target_weights / GiB:.2f} + {pair.drafter_weights / GiB:.2f}",
                 f"{kv_split(pair)}", f"{pair.state_bytes / MiB:.1f}",
                 f"{pair.max_context_tokens(free_bytes):,}", f"{pair.target.context_limit:,}",
                 *(f"{pair.max_sequences(free_bytes, c):,}" for c in CONTEXTS)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m ddtree.memory_plan", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=str(DEFAULT_TARGET),
                    help=f"a checkpoint directory (its config.json) or a known shape: {', '.join(NAMES)}")
    ap.add_argument("--draft", default=None, help="the drafter's directory, a known shape, or 'none' "
                    "(default: the named shape's drafter, the demo drafter for the demo target)")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--free-gib", type=float, default=round(USABLE * H200_GIB, 1),
                    help=f"GiB ddtree may use, weights included (default {USABLE:.0%} of an H200's {H200_GIB} GiB)")
    ap.add_argument("--tree-budget", default=str(DEFAULT_TREE_BUDGET), help="the budget whose buffers are counted")
    ap.add_argument("--no-graphs", action="store_true", help="count an engine without CUDA graphs")
    ap.add_argument("--table", action="store_true", help="print the table of docs/memory.md")
    args = ap.parse_args(argv)
    free = int(args.free_gib * GiB)
    try:
        budget = parse_tree_budget(args.tree_budget)
        if args.table:
            print(table(free, args.dtype, budget, not args.no_graphs))
            return
        target_cfg, drafter_cfg = load_pair(args.target, args.draft)
    except DDTreeError as exc:
        raise SystemExit(f"error: {exc}") from None
    print(f"target {Path(args.target).name}, drafter {'none' if drafter_cfg is None else args.draft or 'default'}")
    if drafter_cfg is None:
        budget = AR  # a target alone decodes without speculation
    print(describe(PairMemory(target_cfg, drafter_cfg, args.dtype, budget, not args.no_graphs), free))
