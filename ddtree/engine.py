"""The DDTree decoding engine: prefill, then rounds of draft -> build -> verify -> walk -> commit.

The engine owns the static caches and runs one sequence at a time. It yields the tokens each step
commits; stop rules, text and statistics belong to the caller (`ddtree.llm`).

Tree budgets: "ar" (plain autoregressive decoding, the drafter is never called), "chain" (DFlash's
linear draft of the block's b - 1 argmax tokens) and an integer B (the best B prefixes). All run
through the same verify / walk / commit code and the same caches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ddtree.config import AR, CHAIN, MAX_TREE_BUDGET, SamplingParams, TreeBudget
from ddtree.models.drafter import DFlashDrafter
from ddtree.models.layers import AttentionMeta
from ddtree.models.target import TargetModel
from ddtree.sampling import choose_tokens
from ddtree.tree import Tree, Walk, build_chain, build_tree, single_node, walk


@dataclass
class Step:
    """What one step committed: `tokens` (new output tokens, in order) and the round's acceptance
    length (accepted tree nodes, root included; 0 for the prefill step)."""

    tokens: list[int]
    acceptance_length: int


class Engine:
    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, max_model_len: int):
        self.target = target
        self.drafter = drafter
        self.max_model_len = max_model_len
        param = next(target.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = drafter.config.block_size if drafter is not None else 0
        self.feature_layers = drafter.config.target_layer_ids if drafter is not None else None
        # Slack past the longest sequence: the scratch slots of the largest tree (or block).
        self.cache = target.new_cache(max_model_len + MAX_TREE_BUDGET + 1, self.device, self.dtype)
        self.draft_cache = (
            drafter.new_cache(max_model_len + self.block_size + 1, self.device, self.dtype) if drafter is not None else None
        )
        # The acceptance rule; tests replace it to show that a wrong rule breaks losslessness.
        self.walk_fn: Callable[[Tree, torch.Tensor], Walk] = walk

    # -- forward helpers ---------------------------------------------------------------------

    def _target(self, tokens, positions, start: int, visible: torch.Tensor | None, causal: bool, logit_rows=None):
        """Run the target on N new tokens whose keys go to slots start..start+N-1 after `start` committed ones."""
        n = tokens.shape[0]
        slots = torch.arange(start, start + n, device=self.device)
        if causal and start == 0:
            mask = None  # prefill from an empty cache: plain causal attention
        else:
            context = torch.ones(n, start, dtype=torch.bool, device=self.device)
            block = torch.ones(n, n, dtype=torch.bool, device=self.device).tril() if causal else visible
            mask = torch.cat([context, block], dim=1)
        meta = AttentionMeta(write_slots=slots, kv_len=start + n, mask=mask, causal=causal and start == 0)
        need_features = self.drafter is not None and self.budget_uses_drafter
        return self.target(tokens, positions, meta, self.cache, self.feature_layers if need_features else None, logit_rows)

    def _draft_logprobs(self, root: torch.Tensor, n: int) -> torch.Tensor:
        """Drafter pass over [root, MASK x (b-1)] at positions n..n+b-1 -> log-probs [b-1, V]."""
        cfg = self.drafter.config
        block = torch.full((self.block_size,), cfg.mask_token_id, dtype=torch.long, device=self.device)
        block[0] = root
        noise = self.target.embed_tokens(block) * cfg.input_embedding_scale
        hidden = self.drafter(noise, n, self.draft_cache)
        return F.log_softmax(self.drafter.logits(hidden[1:], self.target.lm_head), dim=-1)

    # -- generation --------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompt: list[int], params: SamplingParams, budget: TreeBudget) -> Iterator[Step]:
        """Yield the prefill step (one token) and then one Step per round, until the caller stops."""
        if budget != AR and self.drafter is None:
            raise ValueError("tree budgets other than 'ar' need a drafter")
        self.budget_uses_drafter = budget != AR
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,))))

        p = len(prompt)
        tokens = torch.tensor(prompt, dtype=torch.long, device=self.device)
        logits, features = self._target(tokens, torch.arange(p, device=self.device), 0, None, causal=True,
                                        logit_rows=slice(p - 1, p))
        if self.budget_uses_drafter:
            self.drafter.append_context(features, torch.arange(p, device=self.device), self.draft_cache)
        root = choose_tokens(logits, params, generator)[0]
        n = p
        yield Step([int(root)], 0)  # host sync: the first token is needed now (time to first token)

        while True:
            tree = self._make_tree(root, n, budget)
            positions = n + tree.depths
            logits, features = self._target(tree.tokens, positions, n, tree.visible, causal=False)
            choices = choose_tokens(logits, params, generator)
            result = self.walk_fn(tree, choices)
            keep = result.order[: min(tree.size, self.block_size or 1)]
            self.cache.compact(n, keep)
            if self.budget_uses_drafter:
                self.drafter.append_context(features[keep], n + torch.arange(keep.shape[0], device=self.device),
                                            self.draft_cache)
            # The round's one host sync: acceptance length, accepted tokens and the bonus, together.
            summary = torch.cat([result.length.reshape(1), tree.tokens[keep], result.bonus.reshape(1)]).tolist()
            a = summary[0]
            new_tokens = summary[2 : 1 + a] + [summary[-1]]
            n += a
            root = result.bonus
            yield Step(new_tokens, a)

    def _make_tree(self, root: torch.Tensor, n: int, budget: TreeBudget) -> Tree:
        if budget == AR:
            return single_node(root)
        logp = self._draft_logprobs(root, n)
        if budget == CHAIN:
            return build_chain(torch.argmax(logp, dim=-1), root)
        return build_tree(logp, root, int(budget))
