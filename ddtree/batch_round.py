"""The batched engine's fixed-shape round: every live sequence at one tree shape (`BatchEngine.step`
takes it when their budgets agree, the common case under the batch's budget choice; mixed budgets
run the per-row round).

Its shapes depend only on (row bucket R_b, budget, KV length), so on CUDA each half of it is a CUDA
graph, as `ddtree.engine.Engine`'s round is:
- the live sequences hold rows 0..R-1 (`BatchEngine.remove` moves the last one into a freed row),
  so row r of a round is row r, whoever holds it; where its cache region starts is read from the
  engine's device table `first_slot` by every attention launch (the target's verify and the
  drafter's full layers through the batched prefix form, its sliding layers through the batched
  mask form), KV write and commit, so a graph serves any regions;
- R is rounded up to a row bucket (1, 2, 4, ..., max_rows; `pad_rows`, on by default with graphs):
  rows R..R_b-1 are free rows that run as padding, with n = 0 over the engine's spare slots, which
  no sequence holds;
- each row's committed length `n` and root token are read from the engine's device tensors, and
  the back advances them where `live` (padding rows keep n = 0), so a round needs nothing from the
  host but its KV length: one for all rows, the bucketed maximum of n plus the tree (or block);
  each row attends to keys [0, its own n) and its tree (the prefix form), so a larger shared KV
  length is exact.

The two halves, around the target's choice at each node (eager, each row with its own sampling):
- front (R_b, budget, kv_len): one drafter pass over every row's block, each row's tree into the
  key's buffers, then one verify forward of R_b x M tokens laid out row after row (M: the budget's
  nodes), whose tree attention is one launch on CUDA (`layers.PaddedRows`) -> logits [R_b * M, V];
- back (R_b, budget): each row's walk, KV compaction and drafter context, a summary
  [R_b, keep + 2] (acceptance length, kept tokens, bonus), n and root advanced.
On the CPU the same functions run eagerly. A round reads its summary in one host sync; requests
that ask for log-probs add one more. `launch` queues a round without waiting for it and `read`
waits for its summary, so that the engine can queue round r + 1 before reading round r
(`BatchEngine.launch`); the summary's host copy alternates between two buffers for that.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from ddtree.engine import capture_graph
from ddtree.logprobs import chosen_logprobs
from ddtree.models.layers import AttentionMeta, PaddedRows, RowSpan
from ddtree.sampling import choose_tokens
from ddtree.tree import Tree, build_chain, build_tree, single_node
from ddtree.tree_shape import TreeShape

log = logging.getLogger("ddtree.batch_round")


def row_bucket(rows: int, max_rows: int) -> int:
    """The row count a round of `rows` live rows runs at: the next power of two, at most max_rows."""
    bucket = 1
    while bucket < rows:
        bucket *= 2
    return min(bucket, max_rows)


class RowBuffers:
    """Fixed buffers of one (row bucket, budget), shared by its graphs: R rows of M nodes each."""

    def __init__(self, rows: int, size: int, keep: int, engine):
        device, dtype = engine.device, engine.dtype
        self.rows, self.size, self.keep = rows, size, keep
        self.tokens = torch.zeros(rows, size, dtype=torch.long, device=device)
        self.parents = torch.full((rows, size), -1, dtype=torch.long, device=device)
        self.depths = torch.zeros(rows, size, dtype=torch.long, device=device)
        self.valid = torch.zeros(rows, size, dtype=torch.bool, device=device)
        self.visible = torch.zeros(rows, size, size, dtype=torch.bool, device=device)
        self.features = torch.zeros(rows * size, max(engine.feature_dim, 1), dtype=dtype, device=device)
        self.choices = torch.zeros(rows * size, dtype=torch.long, device=device)
        # With graphs, [R * M, V] float32: where every front graph of the key leaves its logits.
        self.logits: torch.Tensor | None = None
        self.offsets = torch.arange(size, device=device)  # node i of row r sits at slot n[r] + i of the row
        self.keep_offsets = torch.arange(keep, device=device)
        self.row_starts = torch.arange(rows, device=device) * size  # row r's nodes in the packed verify
        self.first_slots = engine.first_slot[:rows]  # a view: the engine rewrites it as rows change hands
        self.ones = torch.ones(rows, dtype=torch.long, device=device)  # `ar`'s acceptance length
        self.summary = torch.zeros(rows, keep + 2, dtype=torch.long, device=device)
        self.path = torch.zeros(rows, keep, dtype=torch.long, device=device)  # each row's kept nodes
        cuda = torch.device(device).type == "cuda"
        # Two host copies of the summary, used in turn: a round may be launched before the previous
        # one's summary is read (`BatchEngine.launch`).
        self.summary_host = [torch.zeros(rows, keep + 2, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self.summary_ready = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.rounds = 0
        self.noise = self.block_visible = None
        if engine.drafter is not None:
            # Every row's drafter block [b, H]: its root's embedding (written each round), then the
            # b - 1 mask tokens' (which never change); its full layers see the whole block.
            b = engine.block_size
            self.noise = engine.draft_noise.repeat(rows, 1).view(rows, b, -1).contiguous()
            self.block_visible = torch.ones(rows, b, b, dtype=torch.bool, device=device)
            self.block_offsets = torch.arange(b, device=device)

    def store(self, row: int, tree: Tree) -> None:
        self.tokens[row].copy_(tree.tokens)
        self.parents[row].copy_(tree.parents)
        self.depths[row].copy_(tree.depths)
        self.valid[row].copy_(tree.valid)
        self.visible[row].copy_(tree.visible)

    def trees(self) -> Tree:
        """Every row's tree, stacked ([R, M] and [R, M, M])."""
        return Tree(self.tokens, self.parents, self.depths, self.valid, self.visible)


class UniformRounds:
    """The fixed-shape rounds of a `BatchEngine`: buffers per (row bucket, budget), on CUDA the
    graphs of both halves, captured on first use into one pool."""

    def __init__(self, engine, use_graphs: bool, fused_tree: bool):
        self.engine = engine
        self.use_graphs = use_graphs
        self.fused_tree = fused_tree
        self.buffers: dict[tuple[int, TreeShape], RowBuffers] = {}
        self.tree_plans: dict[TreeShape, object] = {}  # one per budget, for every row bucket
        self.front_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.back_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if use_graphs else None
        # Every capture's warm-up runs here (as `Engine.warmup_stream`: one stream for all of them).
        self.warmup_stream = torch.cuda.Stream(engine.device) if use_graphs else None
        self.capture_seconds = 0.0

    # -- a round -------------------------------------------------------------------------------

    def launch(self, seqs: list, rows: int, budget: TreeShape, kv_len: int) -> tuple:
        """Queue one round of `seqs` (they hold rows 0..len(seqs)-1) run as `rows` rows at `budget`
        and KV length kv_len, and the copy of its summary to the host; nothing here waits for the
        GPU (but a first capture) -> its handle for `read`, with the log-probs at the kept nodes of
        each sequence that asks, by id (device tensors, gathered before a later round reuses the
        buffers)."""
        bufs = self._buffers(rows, budget)
        e = self.engine
        feeds = e.drafter is not None and (budget.drafts or any(seq.feeds_drafter for seq in seqs))
        if self.use_graphs and (rows, budget, feeds) not in self.back_graphs:
            self._capture_back(bufs, budget, feeds)
            log.info("captured batched back graph rows=%d budget=%s", rows, budget)
        logits = self._run_front(bufs, budget, kv_len, feeds)
        self._choose(seqs, bufs, logits)
        self._run_back(bufs, budget, feeds)
        logprobs = {}
        for seq in seqs:
            if seq.params.logprobs is not None:  # the target's log-probs of its choices at the kept nodes
                nodes = bufs.path[seq.row] + seq.row * bufs.size
                logprobs[id(seq)] = chosen_logprobs(logits[nodes], bufs.choices[nodes], seq.params.logprobs)
        return self._copy_summary(bufs), logprobs

    def _choose(self, seqs: list, bufs: RowBuffers, logits: torch.Tensor) -> None:
        """The sampled rows' tokens at their nodes into bufs.choices, each from its own slice with its
        own generator, over the argmax the front wrote for every row (`_front_and_argmax`)."""
        m = bufs.size
        for seq in seqs:
            if not seq.params.greedy:
                nodes = slice(seq.row * m, (seq.row + 1) * m)
                bufs.choices[nodes].copy_(choose_tokens(logits[nodes], seq.params, seq.generator))

    @staticmethod
    def _copy_summary(bufs: RowBuffers) -> tuple:
        """Queue the summary's copy to the next of the two host buffers -> (bufs, its index); on the
        CPU the summary itself, read now."""
        if bufs.summary_ready[0] is None:
            return bufs.summary.tolist(), None
        index = bufs.rounds % 2
        bufs.rounds += 1
        bufs.summary_host[index].copy_(bufs.summary, non_blocking=True)
        bufs.summary_ready[index].record()
        return bufs, index

    @staticmethod
    def read(handle: tuple) -> list[list[int]]:
        """A launched round's summary [a, kept tokens, bonus] by row."""
        bufs, index = handle
        if index is None:
            return bufs
        # The round's one intentional host sync: every row's acceptance length, kept tokens and bonus.
        bufs.summary_ready[index].synchronize()
        return bufs.summary_host[index].tolist()

    # -- front: draft, build, verify -----------------------------------------------------------

    def _front_and_argmax(self, bufs: RowBuffers, budget: TreeShape, kv_len: int, feeds: bool) -> torch.Tensor:
        """`_front`, then every node's argmax into bufs.choices (the greedy rows' tokens; a sampled
        row's are overwritten by `_choose`): inside the front's graph, so that a greedy batch
        launches nothing between the two graphs."""
        logits = self._front(bufs, budget, kv_len, feeds)
        bufs.choices.copy_(torch.argmax(logits, dim=-1))
        return logits

    def _front(self, bufs: RowBuffers, budget: TreeShape, kv_len: int, feeds: bool) -> torch.Tensor:
        """Every row's draft, tree and verify at its device n / root -> logits [R * M, V] (float32)."""
        if budget.drafts:
            self._build(bufs, budget, self._draft(bufs, kv_len))
        else:  # the one node's shape is stored with the buffers
            bufs.tokens[:, 0].copy_(self.engine.root[:bufs.rows])
        return self._verify(bufs, kv_len, feeds)

    def _draft(self, bufs: RowBuffers, kv_len: int) -> torch.Tensor:
        """One drafter pass over every row's block [root, MASK x (b - 1)] at positions n .. n + b - 1
        of its row -> draft logits [R, b - 1, V] (float32)."""
        e, r, b = self.engine, bufs.rows, self.engine.block_size
        drafter, n = e.drafter, e.n[:r]
        bufs.noise[:, 0].copy_(e.target.embed_tokens(e.root[:r]) * drafter.config.input_embedding_scale)
        local = n[:, None] + bufs.block_offsets  # [R, b]: each row's block positions (= slots in its region)
        alone = [drafter.block_metas(n[i], b, self._row_kv_len(i, kv_len)) for i in range(r)]  # as if alone
        slots = (local + bufs.first_slots[:, None]).reshape(-1)
        metas = {kind: AttentionMeta(slots, e.total_slots, rows=[RowSpan(slice(i * b, (i + 1) * b),
                                                                         e.row_first_slots[i], alone[i][kind])
                                                                 for i in range(r)])
                 for kind in alone[0]}
        # On CUDA every row in one launch: the full layers in the prefix form, the sliding layers
        # (a mask each, stacked) in the mask form; elsewhere row by row.
        metas["full"].padded = PaddedRows(bufs.block_visible, n, bufs.first_slots, kv_len)
        if "sliding" in metas and self.use_graphs:  # the masks at the round's kv_len, to stack
            sliding = [drafter.block_metas(n[i], b, kv_len)["sliding"] for i in range(r)]
            masks = torch.stack([meta.mask for meta in sliding])  # [R, b, kv_len]
            ranges = torch.cat([meta.key_range() for meta in sliding])  # [R * b, 2]
            metas["sliding"].padded = PaddedRows(masks, None, bufs.first_slots, kv_len, ranges=ranges)
        hidden = drafter(bufs.noise.view(r * b, -1), metas, e.draft_cache, positions=local.reshape(-1))
        drafted = hidden.view(r, b, -1)[:, 1:].reshape(r * (b - 1), -1)
        return drafter.logits(drafted, e.target.lm_head).view(r, b - 1, -1)

    def _build(self, bufs: RowBuffers, budget: TreeShape, logits: torch.Tensor) -> None:
        """Every row's tree from its draft logits [R, b - 1, V] into the buffers."""
        root = self.engine.root[:bufs.rows]
        if not budget.builds_tree:  # the chain: its shape is stored with the buffers; each depth's argmax
            bufs.tokens[:, 0].copy_(root)
            bufs.tokens[:, 1:].copy_(torch.argmax(logits, dim=-1))
            return
        logp = F.log_softmax(logits, dim=-1)
        plan = self.tree_plans.get(budget)
        if plan is not None:  # every row's tree in the plan's launches
            plan.build(logp, root, bufs.tokens, bufs.parents, bufs.depths, bufs.valid, bufs.visible)
            return
        for i in range(bufs.rows):
            bufs.store(i, build_tree(logp[i], root[i], budget.budget))

    def _verify(self, bufs: RowBuffers, kv_len: int, feeds: bool) -> torch.Tensor:
        """The target over every row's tree, R * M tokens row after row, in one forward -> logits
        [R * M, V] (float32); with `feeds`, the nodes' features into the buffers."""
        e, r, m = self.engine, bufs.rows, bufs.size
        n = e.n[:r]
        local = n[:, None] + bufs.offsets  # [R, M]: each node's slot in its row
        # Each row sees keys [0, its n) and, among its tree's slots, its ancestors (the prefix form).
        rows = [RowSpan(slice(i * m, (i + 1) * m), e.row_first_slots[i],
                        AttentionMeta(local[i], self._row_kv_len(i, kv_len), prefix_len=n[i],
                                      block_mask=bufs.visible[i], **e.recurrent_tree(i, bufs.parents[i], bufs.depths[i])),
                        e.row_states[i] if e.hybrid else None)
                for i in range(r)]
        meta = AttentionMeta((local + bufs.first_slots[:, None]).reshape(-1), e.total_slots,
                             rows=rows, padded=PaddedRows(bufs.visible, n, bufs.first_slots, kv_len))
        positions = (n[:, None] + bufs.depths).reshape(-1)
        taps = e.feature_layers if feeds else None
        logits, features = e.target(bufs.tokens.reshape(-1), positions, meta, e.cache, taps)
        if features is not None:
            bufs.features.copy_(features)
        return logits

    def _row_kv_len(self, row: int, kv_len: int) -> int:
        """The keys row `row` reads where rows go one by one (`layers.attend` off CUDA): the round's,
        short of the cache's end. (These per-row metas hold the host's first slots of this round,
        so a CUDA graph cannot use them; there the batched launches read the device's, and bound
        their reads by the cache's end themselves.)"""
        return min(kv_len, self.engine.total_slots - self.engine.row_first_slots[row])

    # -- back: walk, compact, feed, advance ----------------------------------------------------

    def _back(self, bufs: RowBuffers, budget: TreeShape, feeds: bool) -> None:
        """Each row's walk and KV compaction, the kept nodes' features into the drafter's context
        (with `feeds`), the summary; n and root advance where `live`."""
        e, r = self.engine, bufs.rows
        n, root, live = e.n[:r], e.root[:r], e.live[:r]
        choices = bufs.choices.view(r, bufs.size)
        if budget.single_node:  # one node, whose entries the verify wrote at slot n: nothing to walk or move
            length, bonus = bufs.ones, choices[:, 0]
            if e.hybrid:  # but a hybrid's recurrent layers commit it (not on padding rows)
                e.commit_rows(bufs.first_slots + n, bufs.offsets[:1].expand(r, 1), torch.where(live, 1, 0), 1)
        else:
            result = e.walk_fn(bufs.trees(), choices)  # every row's walk at once
            length, bonus = result.length, result.bonus
            bufs.path.copy_(result.order[:, :bufs.keep])
            # A padding row (and every row in a capture's warm-up) commits nothing to a recurrent state.
            e.commit_rows(bufs.first_slots + n, bufs.path, torch.where(live, length, 0), bufs.size)
        if feeds:  # every row's kept nodes (an `ar` round's one node) become its drafter context
            local = n[:, None] + bufs.keep_offsets
            nodes = (bufs.row_starts[:, None] + bufs.path).reshape(-1)
            e.drafter.append_context(bufs.features[nodes], local.reshape(-1), e.draft_cache,
                                     slots=(local + bufs.first_slots[:, None]).reshape(-1))
        bufs.summary.copy_(torch.cat([length[:, None], bufs.tokens.gather(1, bufs.path), bonus[:, None]], dim=1))
        n.add_(torch.where(live, length, 0))
        root.copy_(torch.where(live, bonus, root))

    # -- buffers and graphs --------------------------------------------------------------------

    def _buffers(self, rows: int, budget: TreeShape) -> RowBuffers:
        """The buffers of (rows, budget), made on first use with the shapes that never change (the
        chain's and `ar`'s) and the budget's tree plan."""
        key = (rows, budget)
        e = self.engine
        e.ensure_scratch(budget.nodes(e.block_size))  # before any capture of this key
        if key in self.buffers:
            return self.buffers[key]
        size = budget.nodes(e.block_size)
        bufs = RowBuffers(rows, size, min(size, e.block_size or 1), e)
        zero = torch.zeros((), dtype=torch.long, device=e.device)
        for i in range(rows):
            if budget.single_node:
                bufs.store(i, single_node(zero))
            elif not budget.builds_tree:
                bufs.store(i, build_chain(zero.expand(e.block_size - 1), zero))
        if budget.builds_tree and self.fused_tree and budget not in self.tree_plans:
            from ddtree.kernels.tree_build import TreeBuildPlan  # imports Triton: only where it is used

            plan = TreeBuildPlan(budget.budget, e.block_size - 1, e.target.config.vocab_size, e.device,
                                 rows=e.max_rows)
            if plan.supported:
                self.tree_plans[budget] = plan
        self.buffers[key] = bufs
        return bufs

    def capture_all(self, rows: int, budget: TreeShape, feeds: bool, kv_lens: list[int]) -> int:
        """Capture the back of (rows, budget, feeds) and its front at each of kv_lens, where not yet
        captured -> how many were new. With no sequences in the engine every row is free (n = 0,
        not live), so the warm-ups write only slots no sequence holds."""
        bufs, before = self._buffers(rows, budget), len(self.front_graphs) + len(self.back_graphs)
        if (rows, budget, feeds) not in self.back_graphs:
            self._capture_back(bufs, budget, feeds)
        for kv_len in kv_lens:
            if (rows, budget, kv_len, feeds) not in self.front_graphs:
                self._capture_front(bufs, budget, kv_len, feeds)
        return len(self.front_graphs) + len(self.back_graphs) - before

    def drop_graphs(self) -> None:
        """Forget every captured graph (they are captured again on their next use)."""
        self.front_graphs.clear()
        self.back_graphs.clear()

    def capture(self, fn) -> tuple[torch.cuda.CUDAGraph, object]:
        start = time.perf_counter()
        graph, out = capture_graph(fn, self.graph_pool, self.warmup_stream)
        torch.cuda.synchronize()  # intentional: capture happens once per graph, outside the round loop
        self.capture_seconds += time.perf_counter() - start
        return graph, out

    def _run_front(self, bufs: RowBuffers, budget: TreeShape, kv_len: int, feeds: bool) -> torch.Tensor:
        if not self.use_graphs:
            return self._front_and_argmax(bufs, budget, kv_len, feeds)
        key = (bufs.rows, budget, kv_len, feeds)
        if key not in self.front_graphs:
            self._capture_front(bufs, budget, kv_len, feeds)
            log.info("captured batched front graph rows=%d budget=%s kv_len=%d", bufs.rows, budget, kv_len)
        graph, logits = self.front_graphs[key]
        graph.replay()
        return logits

    def _capture_front(self, bufs: RowBuffers, budget: TreeShape, kv_len: int, feeds: bool) -> None:
        """The front writes only scratch: the tree buffers, slots [n, n + M) of the target cache and
        [n, n + b) of the drafter's, all rewritten by the replay that follows."""
        if bufs.logits is None:
            bufs.logits = torch.zeros(bufs.rows * bufs.size, self.engine.target.config.vocab_size,
                                      dtype=torch.float32, device=self.engine.device)
        key = (bufs.rows, budget, kv_len, feeds)
        self.front_graphs[key] = self.capture(
            lambda: bufs.logits.copy_(self._front_and_argmax(bufs, budget, kv_len, feeds)))

    def _capture_back(self, bufs: RowBuffers, budget: TreeShape, feeds: bool) -> None:
        """Capture the back of (rows, budget) before this round's front. Its warm-up run is a real
        back over whatever the buffers hold, so it is made harmless: with `live` cleared it advances
        no n and no root, and the entries it moves or writes (target slots [n, n + M), drafter slots
        [n, n + keep) of each row) are scratch that the front about to run rewrites before anything
        reads them; its summary is rewritten by the round's own back."""
        live = self.engine.live
        saved = live.clone()
        live.zero_()
        try:
            self.back_graphs[(bufs.rows, budget, feeds)], _ = self.capture(lambda: self._back(bufs, budget, feeds))
        finally:
            live.copy_(saved)

    def _run_back(self, bufs: RowBuffers, budget: TreeShape, feeds: bool) -> None:
        graph = self.back_graphs.get((bufs.rows, budget, feeds))
        if graph is not None:
            graph.replay()
        else:
            self._back(bufs, budget, feeds)
