"""The model as the server's front process sees it when the engine runs in a process of its own:
the facts /health and the request checks need (`EngineInfo`, sent once by the engine when it is
ready) and the target's tokenizer, loaded here, so that prompts are tokenized and checked without
the engine (`FrontModel`: the calls of `LLM` that the app makes)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ddtree.config import DDTreeError, parse_tree_budget
from ddtree.models.tokenizer import load_tokenizer
from ddtree.request_checks import RequestChecks
from ddtree.tree_shape import TreeShape


@dataclass(frozen=True)
class EngineInfo:
    """What the front needs to know of the engine's LLM (plain values: it crosses the pipe)."""

    target_path: str
    draft_name: str | None
    block_size: int
    default_budget: str  # its label
    max_model_len: int
    max_num_seqs: int
    vocab_size: int
    device: str
    dtype: str  # "bfloat16", ...
    has_drafter: bool
    adaptive_batch: bool  # requests that name no budget have it chosen by their batch each round
    tree_budget_mode: str  # "fixed", "adaptive" or "auto"

    @classmethod
    def of(cls, llm, tree_budget_mode: str) -> "EngineInfo":
        return cls(str(llm.target_path), llm.draft_name, llm.block_size, llm.default_budget.label, llm.max_model_len,
                   llm.max_num_seqs, llm.vocab_size, str(llm.device), str(llm.dtype).replace("torch.", ""),
                   llm.drafter is not None, llm.adapts(None), tree_budget_mode)


class FrontModel(RequestChecks):
    """`LLM`'s request-side calls (prompt ids, chat template, checks, /health's facts) without its
    models. A request that names no tree budget is checked with none (`check_request` -> None):
    the engine chooses it when the request starts, from what it has measured."""

    def __init__(self, info: EngineInfo, preloaded: tuple | None = None):
        """preloaded: (target path, its tokenizer), loaded while the engine loaded; used when it is
        the engine's target."""
        self.info = info
        self.target_path = Path(info.target_path)
        if preloaded is not None and Path(preloaded[0]).resolve() == self.target_path.resolve():
            self.tokenizer = preloaded[1]
        else:
            self.tokenizer = load_tokenizer(self.target_path)
        self.vocab_size = info.vocab_size
        self.max_model_len = info.max_model_len
        self.max_num_seqs = info.max_num_seqs
        self.block_size = info.block_size
        self.default_budget = parse_tree_budget(info.default_budget)
        self.device = info.device
        self.dtype = info.dtype

    @property
    def target_name(self) -> str:
        return self.target_path.name

    @property
    def draft_name(self) -> str | None:
        return self.info.draft_name

    def adapts(self, tree_budget: object) -> bool:
        return tree_budget is None and self.info.adaptive_batch

    def _budget(self, tree_budget: object, temperature: float = 0.0, context_tokens: int = 0) -> TreeShape | None:
        if tree_budget is None:
            return None
        budget = parse_tree_budget(tree_budget)
        if budget.drafts and not self.info.has_drafter:
            raise DDTreeError("this engine has no drafter: only tree budget 'ar' is available", "tree_budget")
        return budget
