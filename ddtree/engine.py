"""The DDTree decoding engine: prefill, then rounds of draft -> build -> verify -> walk -> commit.

The engine owns the static caches and runs one sequence at a time. It yields the tokens each step
commits; stop rules, text and statistics belong to the caller (`ddtree.llm`).

Tree budgets: "ar" (plain autoregressive decoding, the drafter is never called), "chain" (DFlash's
linear draft of the block's b - 1 argmax tokens) and an integer B (the best B prefixes). All run
through the same verify / walk / commit code and the same caches.

A round is two fixed-shape halves around the target's choice at each node:
- front (draft, build, verify): reads the committed length `n` and the root token from device
  tensors, writes the tree and the verify features into per-budget buffers, returns logits [N, V];
- back (walk, compact, commit): reads those buffers and the choices [N], moves the accepted
  nodes' KV entries into place, appends their features to the drafter's context and writes a
  summary [acceptance length, the kept nodes' tokens, bonus].
On CUDA each half is a CUDA graph (front: one per budget and KV-length bucket; back: one per
budget); on the CPU the same functions run eagerly. The back also advances the committed length
`n` and the root on the device, so the next round needs nothing from the host but a KV bucket.

Rounds overlap with the host (`overlap`, on by default): round r + 1 is launched before round r's
summary is read, so the host's work on round r's tokens (text, stop rules, streaming) runs while
the GPU computes round r + 1 instead of leaving it idle. Round r + 1's KV bucket comes from an
upper bound of n (round r accepts at most `keep` nodes). A request that stops leaves one launched
round behind; it writes only slots past its committed length, so the next request is unaffected.
Near max_tokens, where round r may end the request by length, round r + 1 waits for round r's
summary instead. The only host sync of a round is reading its summary (with, for a request that
asks for log-probs, those of its emitted tokens, gathered from the verify's logits after the back and
copied with it: ddtree.logprobs).

The prefill of a prompt of up to PREFILL_PAD_MAX tokens is padded to the next of a few fixed
lengths (`prefill_lengths`), on CUDA one graph each: one replay instead of ~100 launches and the
compiled functions' guards (on the demo pair the time to first token went from a mean 5-10 ms to
0.35 ms, benchmarks/README.md). The padding is causally invisible to the prompt and writes only
cache slots past n, which no later query sees before a round overwrites them. A longer prompt is
prefilled eagerly in forwards of at most `prefill_chunk` tokens (`prefill_chunks`): the first
causal from an empty cache, each later one seeing the cached prefix and itself causally, so that
a forward's activations ([C, intermediate_size] in the MLP, the recurrent layers' float32 copies)
stay bounded whatever the prompt's length.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ddtree.bounded_compile import CompiledForFirstSizes
from ddtree.config import MAX_TREE_BUDGET, PREFILL_CHUNK, SamplingParams  # noqa: F401 (PREFILL_CHUNK: for callers)
from ddtree.logprobs import RoundLogprobs, TokenLogprob, as_token_logprobs, chosen_logprobs
from ddtree.models.drafter import DFlashDrafter
from ddtree.models.layers import AttentionMeta
from ddtree.models.target import TargetModel
from ddtree.sampling import choose_tokens
from ddtree.tree import Tree, Walk, build_chain, build_tree, single_node, walk
from ddtree.tree_shape import TreeShape

log = logging.getLogger("ddtree.engine")

PREFILL_PAD_MAX = 1024  # longer prompts are prefilled eagerly, in chunks (prefill_chunks)
WALK_COMPILED_SIZES = 32  # tree sizes (budgets) whose walk is compiled; the rest run it eagerly


def prefill_lengths(limit: int) -> list[int]:
    """The padded prefill lengths up to `limit`: 16, 24, 32, 48, 64, 96, ... (each step 1.5x or
    4/3x, so beyond 16 tokens padding adds at most half the prompt)."""
    lengths, x = [], 16
    while x <= limit:
        lengths.append(x)
        x = x * 3 // 2 if x & (x - 1) == 0 else x * 4 // 3
    return lengths


def prefill_chunks(length: int, chunk: int, device) -> list[tuple[slice, AttentionMeta, slice]]:
    """How a prompt of `length` tokens is prefilled: forwards of at most `chunk` tokens, each as
    (its rows of the prompt, its attention meta alone, its logit rows: its last token, which in
    the last forward is the prompt's; the others' logits are dropped, one row each rather than
    none, a zero-row shape the compiled code would meet nowhere else). The first is causal from
    an empty cache; the one at positions [s, s + c) sees keys [0, s) (the prefix, already cached)
    and itself causally, which for recurrent layers (a meta neither causal nor a tree) advances
    the state the prefix left. Its `min_prefix` is s itself (each chunk's meta serves one eager
    forward) and it is marked a `chunk`, so that a long prefix goes through the tree attention's
    prefix kernel and the chunk's own keys through a causal one (`tree_attention.masked_attention`)."""
    chunks, causal = [], None
    for start in range(0, length, chunk):
        c = min(chunk, length - start)
        positions = torch.arange(start, start + c, device=device)
        if start == 0:
            meta = AttentionMeta(positions, c, None, causal=True)
        else:
            if causal is None:  # [chunk, chunk], made once; a shorter last chunk takes its top-left corner
                causal = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
            meta = AttentionMeta(positions, start + c, prefix_len=torch.tensor(start, device=device),
                                 block_mask=causal[:c, :c], min_prefix=start, chunk=True)
        chunks.append((slice(start, start + c), meta, slice(c - 1, c)))
    return chunks


@dataclass
class Step:
    """What one step committed: `tokens` (new output tokens, in order) and the round's acceptance
    length (accepted tree nodes, root included; 0 for the prefill step); with params.logprobs set,
    the target's log-prob of each token (ddtree.logprobs). `budget`: the round's tree shape, set by
    the batched engine, where a request's budget may change from round to round."""

    tokens: list[int]
    acceptance_length: int
    logprobs: list[TokenLogprob] | None = None
    budget: TreeShape | None = None


class RoundBuffers:
    """Fixed buffers of one budget, shared by its graphs: the tree, the verify features, the
    choices and the summary the host reads."""

    def __init__(self, size: int, keep: int, feature_dim: int, device, dtype, scratch=None):
        self.size, self.keep = size, keep
        self.scratch = scratch  # a hybrid target's per-node stash for the commit (None for dense targets)
        self.tokens = torch.zeros(size, dtype=torch.long, device=device)
        self.parents = torch.full((size,), -1, dtype=torch.long, device=device)
        self.depths = torch.zeros(size, dtype=torch.long, device=device)
        self.valid = torch.zeros(size, dtype=torch.bool, device=device)
        self.visible = torch.zeros(size, size, dtype=torch.bool, device=device)
        self.features = torch.zeros(size, max(feature_dim, 1), dtype=dtype, device=device)
        self.choices = torch.zeros(size, dtype=torch.long, device=device)
        # With CUDA graphs, [size, V] float32: where every front graph of the budget leaves its
        # verify's logits (Engine._capture_front). One per budget rather than one per graph (one per
        # KV bucket): a graph's own output would stay allocated with it, N x V x 4 bytes for each 256
        # tokens of context.
        self.logits: torch.Tensor | None = None
        self.offsets = torch.arange(size, device=device)  # node i's slot is n + i
        self.summary = torch.zeros(keep + 2, dtype=torch.long, device=device)
        # The kept nodes (accepted first, in depth order), for log-probs: the tokens a round emits
        # are the target's choices at its accepted nodes. "ar"'s one node is node 0.
        self.path = torch.zeros(keep, dtype=torch.long, device=device)
        self.logprobs = RoundLogprobs(keep, device)
        # Two host copies of the summary, so that round r + 1's copy can be in flight while round
        # r's is read; pinned on CUDA (an asynchronous copy needs page-locked memory).
        cuda = torch.device(device).type == "cuda"
        self.summary_host = [torch.zeros(keep + 2, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.summary_ready = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.rounds = 0  # rounds launched: which host copy the next one uses

    def store(self, tree: Tree) -> None:
        self.tokens.copy_(tree.tokens)
        self.parents.copy_(tree.parents)
        self.depths.copy_(tree.depths)
        self.valid.copy_(tree.valid)
        self.visible.copy_(tree.visible)

    @property
    def tree(self) -> Tree:
        return Tree(self.tokens, self.parents, self.depths, self.valid, self.visible)


def capture_graph(fn: Callable[[], object], pool=None,
                  stream: torch.cuda.Stream | None = None) -> tuple[torch.cuda.CUDAGraph, object]:
    """Run `fn` once on a side stream (allocations, lazy compiles), then capture it -> (graph, its
    output). stream: the side stream; pass the same one for every capture of a long-lived owner,
    since the caching allocator keeps each stream's freed blocks for that stream alone."""
    stream = stream if stream is not None else torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class Engine:
    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None, max_model_len: int,
                 use_graphs: bool | None = None, kv_bucket: int | None = None, compile_layers: bool | None = None,
                 fused_tree: bool | None = None, padded_prefill: bool | None = None, overlap: bool = True,
                 prefill_chunk: int = PREFILL_CHUNK):
        """padded_prefill (default: use_graphs): prefill short prompts padded to `prefill_lengths`
        (what graphs need; an eager engine given it runs the graphs' exact shapes).
        prefill_chunk: the most tokens one forward of an eager prefill runs (`prefill_chunks`).
        overlap: launch each round before reading the previous round's summary (module docstring);
        False reads every summary before the next launch. The tokens are the same either way."""
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.overlap = overlap
        self.prefill_chunk = prefill_chunk
        self.target = target
        self.drafter = drafter
        self.max_model_len = max_model_len
        param = next(target.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        compiled = compile_layers if compile_layers is not None else self.use_graphs
        if drafter is not None:
            drafter.fuse_projections()  # one matmul for q/k/v, one for every layer's context k/v
        if isinstance(target, TargetModel):
            target.fold_norms_if_asked()
        if compiled:
            target.use_compiled()
            if drafter is not None:
                drafter.use_compiled()
        # The walk, ~15 small operators eagerly, a few kernels compiled (one variant per budget).
        # It is the acceptance rule; tests replace it to show that a wrong rule breaks losslessness.
        # Compiled per tree size, so only for the first few budgets (CompiledForFirstSizes says why).
        self.walk_fn: Callable[[Tree, torch.Tensor], Walk] = \
            CompiledForFirstSizes(walk, WALK_COMPILED_SIZES, lambda tree, choices: tree.size) if compiled else walk
        # Graphs bake in the KV length: round it up to a bucket so one graph serves many rounds.
        self.kv_bucket = kv_bucket or (256 if self.use_graphs else 1)
        self.block_size = drafter.config.block_size if drafter is not None else 0
        self.feature_layers = drafter.config.target_layer_ids if drafter is not None else None
        self.feature_dim = len(self.feature_layers) * target.config.hidden_size if drafter is not None else 0
        # The drafter's input block [b, H]: the root's embedding, then b - 1 mask tokens' (scaled as
        # the drafter's config says), which never change; each round writes only row 0.
        self.draft_noise = None
        if drafter is not None:
            mask = torch.full((self.block_size,), drafter.config.mask_token_id, dtype=torch.long, device=self.device)
            with torch.no_grad():
                noise = target.embed_tokens(mask)
                scale = drafter.config.input_embedding_scale
                self.draft_noise = noise * scale if scale != 1.0 else noise
        # Slack past the longest sequence: the scratch slots of the largest tree (or block), bucketed.
        slots = max_model_len + MAX_TREE_BUDGET + 1 + self.kv_bucket
        self.cache = target.new_cache(slots, self.device, self.dtype)
        self.draft_cache = drafter.new_cache(slots, self.device, self.dtype) if drafter is not None else None
        self.n = torch.zeros((), dtype=torch.long, device=self.device)  # committed length
        self._host_n = 0  # the same after the last round whose summary the host has read
        self.root = torch.zeros((), dtype=torch.long, device=self.device)  # next bonus token
        pad = self.use_graphs if padded_prefill is None else padded_prefill
        self.prefill_lengths = prefill_lengths(min(PREFILL_PAD_MAX, max_model_len)) if pad else []
        longest = self.prefill_lengths[-1] if self.prefill_lengths else 0
        self.prompt_tokens = torch.zeros(longest, dtype=torch.long, device=self.device)  # past n: padding
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._one = torch.ones(1, dtype=torch.long, device=self.device)  # ar's acceptance length
        self.buffers: dict[TreeShape, RoundBuffers] = {}
        self.front_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.back_graphs: dict[TreeShape, torch.cuda.CUDAGraph] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Every capture's warm-up runs here: a new stream per capture would leave each warm-up's
        # freed blocks cached for a stream no one uses again (reserved memory growing per graph).
        self.warmup_stream = torch.cuda.Stream(self.device) if self.use_graphs else None
        # The tree build as Triton kernels (ddtree.kernels.tree_build) where Triton and CUDA are
        # present; `build_tree` (the same result, ~10 operators per depth) elsewhere.
        self.fused_tree = (self.device.type == "cuda") if fused_tree is None else fused_tree
        self.tree_plans: dict[TreeShape, object] = {}
        self.capture_seconds = 0.0

    # -- the two halves of a round -------------------------------------------------------------

    def _draft_logits(self, root: torch.Tensor, n: torch.Tensor, kv_len: int, min_prefix: int = 0) -> torch.Tensor:
        """Drafter pass over [root, MASK x (b-1)] at positions n..n+b-1 -> logits [b-1, V] (float32).
        kv_len >= n + b: the (bucketed) number of drafter cache slots read; min_prefix: a lower bound
        of n for every run at kv_len (`_min_prefix`: the drafter's context is the committed sequence)."""
        scale = self.drafter.config.input_embedding_scale
        noise = self.draft_noise  # rows 1.. hold the mask token's embedding since __init__
        torch.index_select(self.target.embed_tokens.weight, 0, root.reshape(1), out=noise[:1])
        if scale != 1.0:
            noise[:1].mul_(scale)
        hidden = self.drafter(noise, self.drafter.block_metas(n, self.block_size, kv_len, min_prefix), self.draft_cache)
        return self.drafter.logits(hidden[1:], self.target.lm_head)

    def _build(self, budget: TreeShape, logits: torch.Tensor, root: torch.Tensor) -> None:
        """The draft tree from the drafter's logits [b - 1, V] into the budget's buffers (not for "ar")."""
        bufs = self.buffers[budget]
        plan = self.tree_plans.get(budget)
        if not budget.builds_tree:
            # The chain's shape never changes (stored in prepare): only its tokens are written, each
            # depth's argmax (of the logits: the log-softmax would not change it, and costs a launch).
            bufs.tokens[:1].copy_(root.reshape(1))
            bufs.tokens[1:].copy_(torch.argmax(logits, dim=-1))
            return
        logp = F.log_softmax(logits, dim=-1)
        if plan is not None:
            plan.build(logp, root, bufs.tokens, bufs.parents, bufs.depths, bufs.valid, bufs.visible)
        else:
            bufs.store(build_tree(logp, root, budget.budget))

    def _verify(self, budget: TreeShape, kv_len: int) -> torch.Tensor:
        """The target over the budget's tree at the current n -> logits [N, V] (float32); the
        drafter's features of every node into the buffers."""
        bufs = self.buffers[budget]
        tree, n = bufs.tree, self.n
        # Every node sees the context [0, n) and its ancestors among the tree's slots n .. n + N - 1.
        # Recurrent layers (hybrid targets) read the tree's shape and stash what the commit needs:
        # a verify never writes their state, so a graph's warm-up run cannot advance it.
        meta = AttentionMeta(n + bufs.offsets, kv_len, prefix_len=n, block_mask=tree.visible,
                             min_prefix=self._min_prefix(budget, kv_len), parents=tree.parents, depths=tree.depths,
                             scratch=bufs.scratch)
        taps = self.feature_layers if budget.drafts else None
        logits, features = self.target(tree.tokens, n + tree.depths, meta, self.cache, taps)
        if features is not None:
            bufs.features.copy_(features)
        return logits

    def _front(self, budget: TreeShape, kv_len: int) -> torch.Tensor:
        """Draft, build and verify at the current n / root -> target logits [N, V] (float32)."""
        bufs = self.buffers[budget]
        if not budget.drafts:
            bufs.tokens.copy_(self.root.reshape(1))  # the one node's shape is stored in prepare
        else:
            self._build(budget, self._draft_logits(self.root, self.n, kv_len, self._min_prefix(budget, kv_len)),
                        self.root)
        return self._verify(budget, kv_len)

    def _front_into_buffer(self, budget: TreeShape, kv_len: int) -> torch.Tensor:
        """`_front` with its logits copied into the budget's one logits buffer, for capture: the
        front's own logits are then a temporary that the graph pool reuses. The copy moves 2 N V x 4
        bytes (79 MB at budget 64 and Qwen3's vocabulary: about 18 us at 4.3 TB/s), against N x V x 4
        bytes kept per KV bucket otherwise."""
        logits = self.buffers[budget].logits
        logits.copy_(self._front(budget, kv_len))
        return logits

    def _capture_front(self, budget: TreeShape, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture the budget's front at KV length kv_len; its logits buffer is allocated with the
        first (outside the capture: a budget that never runs a round never holds one)."""
        bufs = self.buffers[budget]
        if bufs.logits is None:
            bufs.logits = torch.zeros(bufs.size, self.target.config.vocab_size, dtype=torch.float32, device=self.device)
        return self.capture(lambda: self._front_into_buffer(budget, kv_len))

    def _back(self, budget: TreeShape) -> None:
        """Walk the tree with the choices, compact the KV cache, extend the drafter's context, write the summary."""
        bufs = self.buffers[budget]
        tree = bufs.tree
        if budget.single_node:
            # One node, whose entries the verify already wrote at slot n: nothing to walk or move
            # (a hybrid target's recurrent layers still commit the node).
            if bufs.scratch is not None:
                self.target.commit(self.cache, self.n, bufs.offsets[:1], self._one[0], bufs.scratch)
            bufs.summary.copy_(torch.cat([self._one, tree.tokens[:1], bufs.choices[:1]]))
            self.n.add_(1)
            self.root.copy_(bufs.choices[0])
            return
        result = self.walk_fn(tree, bufs.choices)
        keep = result.order[: bufs.keep]
        bufs.path.copy_(keep)
        self.target.commit(self.cache, self.n, keep, result.length, bufs.scratch)
        positions = self.n + bufs.offsets[: bufs.keep]
        self.drafter.append_context(bufs.features[keep], positions, self.draft_cache)
        bufs.summary.copy_(torch.cat([result.length.reshape(1), tree.tokens[keep], result.bonus.reshape(1)]))
        self.n.add_(result.length)
        self.root.copy_(result.bonus)

    def _prefill(self, tokens: torch.Tensor, meta: AttentionMeta, last: torch.Tensor | slice,
                 taps: list[int] | None) -> torch.Tensor:
        """Prompt tokens [L] at positions meta.write_slots -> logits [rows, V] (float32) of rows
        `last`. Writes the target cache's slots there and, with `taps`, the drafter's context."""
        positions = meta.write_slots
        logits, features = self.target(tokens, positions, meta, self.cache, taps, logit_rows=last)
        if features is not None:
            self.drafter.append_context(features, positions, self.draft_cache)
        return logits

    def _padded_prefill(self, length: int) -> torch.Tensor:
        """The prompt in prompt_tokens[:n], padded to `length`, in one causal forward, with the
        drafter's context always written, so that one graph serves every budget; recurrent layers
        stop at n (the rest is padding)."""
        positions = torch.arange(length, device=self.device)
        meta = AttentionMeta(positions, length, None, causal=True, length=self.n)
        return self._prefill(self.prompt_tokens[:length], meta, (self.n - 1).reshape(1), self.feature_layers)

    def _prefill_chunked(self, tokens: torch.Tensor, taps: list[int] | None) -> torch.Tensor:
        """The prompt tokens [P] at their exact length, in forwards of at most `prefill_chunk`
        tokens (`prefill_chunks`) -> logits [1, V] (float32) of the last token."""
        for rows, meta, last in prefill_chunks(tokens.shape[0], self.prefill_chunk, self.device):
            logits = self._prefill(tokens[rows], meta, last, taps)
        return logits

    # -- graphs --------------------------------------------------------------------------------

    def _bucket_len(self, needed: int) -> int:
        return -(-needed // self.kv_bucket) * self.kv_bucket

    def capture(self, fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
        """Warm `fn` up on a side stream, then capture it into the engine's graph pool (CUDA only).
        fn must only write scratch state."""
        start = time.perf_counter()
        graph, out = capture_graph(fn, self.graph_pool, self.warmup_stream)
        torch.cuda.synchronize()  # intentional: capture happens once per graph, outside the round loop
        self.capture_seconds += time.perf_counter() - start
        return graph, out

    def _run_front(self, budget: TreeShape, n_bound: int) -> torch.Tensor:
        """The front at the device's n, known on the host only as n <= n_bound."""
        kv_len = self._front_kv_len(budget, n_bound)
        if not self.use_graphs:
            return self._front(budget, kv_len)
        key = (budget, kv_len)
        if key not in self.front_graphs:
            start = time.perf_counter()
            self.front_graphs[key] = self._capture_front(budget, kv_len)
            log.info("captured front graph budget=%s kv_len=%d in %.2f s", budget, kv_len, time.perf_counter() - start)
        graph, logits = self.front_graphs[key]
        graph.replay()
        return logits

    def _run_prefill(self, length: int) -> torch.Tensor:
        if not self.use_graphs:
            return self._padded_prefill(length)
        if length not in self.prefill_graphs:
            start = time.perf_counter()
            self.prefill_graphs[length] = self.capture(lambda: self._padded_prefill(length))
            log.info("captured prefill graph length=%d in %.2f s", length, time.perf_counter() - start)
        graph, logits = self.prefill_graphs[length]
        graph.replay()
        return logits

    def prefill_padded(self, prompt: list[int]) -> torch.Tensor | None:
        """A prompt of up to the longest of `prefill_lengths` tokens, padded to the next of them, from
        slot 0 of this engine's caches (the target's KV, the drafter's context, a hybrid's recurrent
        state) in one forward, a graph replay with graphs; n set to its length -> logits [1, V]
        (float32; with graphs, the graph's output, rewritten by its next replay). None for a longer
        prompt, which the caller prefills in chunks."""
        p = len(prompt)
        length = next((x for x in self.prefill_lengths if x >= p), None)
        if length is None:
            return None
        self.n.fill_(p)
        # From pinned memory without waiting: the host goes on queueing (the allocator keeps the
        # pinned block until the copy is done).
        pinned = self.device.type == "cuda"
        self.prompt_tokens[:p].copy_(torch.tensor(prompt, dtype=torch.long, pin_memory=pinned), non_blocking=pinned)
        return self._run_prefill(length)

    def capture_prefills(self) -> int:
        """With graphs, capture now the prefill graph of every padded length not yet captured ->
        how many were captured."""
        if not self.use_graphs:
            return 0
        missing = [length for length in self.prefill_lengths if length not in self.prefill_graphs]
        self.n.fill_(1)  # the prefill's logit row is n - 1
        for length in missing:
            self.prefill_graphs[length] = self.capture(lambda: self._padded_prefill(length))
        self.n.zero_()
        self._host_n = 0
        return len(missing)

    def _run_back(self, budget: TreeShape) -> None:
        if budget in self.back_graphs:
            self.back_graphs[budget].replay()
        else:
            self._back(budget)

    def prepare(self, budget: TreeShape) -> None:
        """Allocate a budget's buffers and, on CUDA, capture its back graph (before any sequence
        state exists, because warming it up moves cache entries)."""
        if budget in self.buffers:
            return
        size = budget.nodes(self.block_size)
        keep = min(size, self.block_size or 1)
        scratch = self.target.new_scratch(size, self.device, self.dtype)
        self.buffers[budget] = RoundBuffers(size, keep, self.feature_dim, self.device, self.dtype, scratch)
        zero = torch.zeros((), dtype=torch.long, device=self.device)
        if budget.single_node:
            self.buffers[budget].store(single_node(zero))
        elif not budget.builds_tree:  # the chain: its shape is fixed, each round writes only its tokens
            self.buffers[budget].store(build_chain(zero.expand(self.block_size - 1), zero))
        elif self.fused_tree:
            from ddtree.kernels.tree_build import TreeBuildPlan  # imports Triton: only where it is used

            plan = TreeBuildPlan(budget.budget, self.block_size - 1, self.target.config.vocab_size, self.device)
            if plan.supported:
                self.tree_plans[budget] = plan
            else:
                log.info("tree budget %s: no fused tree build for this size, using build_tree", budget)
        if self.use_graphs:
            self.n.zero_()
            start = time.perf_counter()
            self.back_graphs[budget], _ = self.capture(lambda: self._back(budget))
            log.info("captured back graph budget=%s in %.2f s", budget, time.perf_counter() - start)

    def release(self, budget: TreeShape) -> None:
        """Free a budget's buffers, tree plan and graphs; `prepare` makes them again when the budget
        is next used. Call between requests."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # a round a finished request left launched may still use them
        self.buffers.pop(budget, None)
        self.tree_plans.pop(budget, None)
        self.back_graphs.pop(budget, None)
        for key in [key for key in self.front_graphs if key[0] == budget]:
            del self.front_graphs[key]

    def _front_kv_len(self, budget: TreeShape, host_n: int) -> int:
        """KV slots the front reads at committed length host_n: the tree's (or block's) scratch
        slots included, rounded up to the bucket."""
        return self._bucket_len(host_n + max(budget.nodes(self.block_size), self.block_size))

    def _min_prefix(self, budget: TreeShape, kv_len: int) -> int:
        """The least committed length n a front at kv_len runs at: it runs where
        `_front_kv_len(budget, n_bound) == kv_len`, so n_bound > kv_len - kv_bucket - the slots it adds,
        and n_bound (the host's n plus at most one unread round's keep) exceeds n by at most keep."""
        added = max(budget.nodes(self.block_size), self.block_size)
        return max(0, kv_len - self.kv_bucket - added + 1 - self.buffers[budget].keep)

    def front_kv_lens(self, budget: TreeShape) -> list[int]:
        """Every KV length the front can run at for sequences of up to max_model_len tokens."""
        first, last = self._front_kv_len(budget, 0), self._front_kv_len(budget, self.max_model_len - 1)
        return list(range(first, last + 1, self.kv_bucket))

    def capture_all(self, budget: TreeShape) -> None:
        """prepare(budget), then capture every prefill graph and the front graph of every KV
        bucket a sequence of up to max_model_len tokens can reach. Call between requests: the
        warm-ups write scratch slots."""
        self.prepare(budget)
        if not self.use_graphs:
            return
        start = time.perf_counter()
        self.capture_prefills()
        for kv_len in self.front_kv_lens(budget):
            if (budget, kv_len) not in self.front_graphs:
                self.front_graphs[(budget, kv_len)] = self._capture_front(budget, kv_len)
        log.info("captured the prefill graphs and the front graphs of budget=%s in %.2f s", budget,
                 time.perf_counter() - start)

    def round_phases(self, budget: TreeShape) -> dict[str, Callable[[], object]]:
        """A round of a prepared `budget` at the current state, as phases that each run alone, in
        round order: "draft" and "build" (budgets that draft), "verify", "walk_commit". For timing
        them one by one (benchmarks/round_latency.py), e.g. each captured with `capture`.

        The build reuses the logits of one draft run made here. Draft, build and verify write only
        slots past the committed length, so they may run any number of times; "walk_commit" commits
        a round (n advances on every run), so it belongs at the end of a sequence."""
        # A round may still be in flight: n is at most one round's keep past what the host read.
        kv_len = self._front_kv_len(budget, self._host_n + self.buffers[budget].keep)
        phases: dict[str, Callable[[], object]] = {}
        if budget.drafts:
            phases["draft"] = lambda: self._draft_logits(self.root, self.n, kv_len, self._min_prefix(budget, kv_len))
            logits = phases["draft"]()  # the build's log-softmax counts as build
            phases["build"] = lambda: self._build(budget, logits, self.root)
        phases["verify"] = lambda: self._verify(budget, kv_len)
        phases["walk_commit"] = lambda: self._back(budget)
        return phases

    # -- generation ----------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(self, prompt: list[int], params: SamplingParams, budget: TreeShape) -> Iterator[Step]:
        """Yield the prefill step (one token) and then one Step per round, until the caller stops."""
        if budget.drafts and self.drafter is None:
            raise ValueError("tree budgets other than 'ar' need a drafter")
        self.prepare(budget)
        bufs = self.buffers[budget]
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,))))

        p = len(prompt)
        logits = self.prefill_padded(prompt)
        if logits is None:
            self.n.fill_(p)
            tokens = torch.tensor(prompt, dtype=torch.long, device=self.device)
            logits = self._prefill_chunked(tokens, self.feature_layers if budget.drafts else None)
        self.root.copy_(choose_tokens(logits, params, generator)[0])
        self._host_n = p
        first = int(self.root)  # host sync: the first token is needed now (time to first token)
        k = params.logprobs
        yield Step([first], 0, None if k is None else self._first_logprobs(logits, first, k))

        outputs = 1  # tokens yielded so far
        in_flight = None  # the launched round whose summary is not read yet: its host copy's index
        while True:
            launched = None
            # Launch ahead only while the unread round cannot end the request by length.
            if in_flight is None or (self.overlap and outputs + bufs.keep < params.max_tokens):
                ahead = bufs.keep if in_flight is not None else 0  # what the unread round may add to n
                launched = self._launch_round(budget, self._host_n + ahead, params, generator)
            if in_flight is not None:
                summary = self._read_summary(bufs, in_flight)
                a = summary[0]
                self._host_n += a
                outputs += a
                tokens = summary[2 : 1 + a] + [summary[-1]]
                yield Step(tokens, a, None if k is None else bufs.logprobs.read(in_flight, tokens, k))
            in_flight = launched

    def _first_logprobs(self, logits: torch.Tensor, first: int, k: int) -> list[TokenLogprob]:
        """The prefill's token's log-prob, from its logits [1, V] (read at the first token's sync)."""
        values = chosen_logprobs(logits.reshape(1, -1), self.root.reshape(1), k)
        return as_token_logprobs([first], *(t.tolist() for t in values))

    def _launch_round(self, budget: TreeShape, n_bound: int, params: SamplingParams,
                      generator: torch.Generator | None) -> int:
        """Queue one round (front, choice, back) and the copy of its summary to the host; return
        the index of the host copy. Nothing here waits for the GPU."""
        bufs = self.buffers[budget]
        logits = self._run_front(budget, n_bound)
        bufs.choices.copy_(choose_tokens(logits, params, generator))
        self._run_back(budget)
        index = bufs.rounds % 2
        bufs.rounds += 1
        if params.logprobs is not None:  # the raw log-probs of the choices at the kept nodes
            bufs.logprobs.gather(logits, bufs.path, bufs.choices.index_select(0, bufs.path), params.logprobs, index)
        bufs.summary_host[index].copy_(bufs.summary, non_blocking=True)
        if bufs.summary_ready[index] is not None:
            bufs.summary_ready[index].record()
        return index

    @staticmethod
    def _read_summary(bufs: RoundBuffers, index: int) -> list[int]:
        """[acceptance length a, kept tokens (keep), bonus] of a launched round."""
        if bufs.summary_ready[index] is not None:
            # The round's one host sync: acceptance length, kept tokens and bonus, together.
            bufs.summary_ready[index].synchronize()
        return bufs.summary_host[index].tolist()
