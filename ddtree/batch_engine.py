"""Many sequences decoded together: each round drafts every live sequence's block in one drafter
pass and verifies every sequence's tree in one target forward.

A sequence owns a row of the batch and a region of the caches: contiguous slots of the target's
and the drafter's KV caches, sized by what it can reach (its prompt, its max_new tokens and its
largest tree, `region_slots`), taken from one pool (`ddtree.kv_regions.SlotRegions`) whose size is
the caller's (`cache_slots`: by default room for max_rows sequences at the context limit; a server
sizes it from the device's free memory), so that the sequences at once are bounded by their
lengths, not by max_model_len. The R live sequences hold rows 0..R-1: when one leaves, the sequence
in the last row takes its row (a row is an index into the device table `first_slot`; the region
and its entries stay where they are). Inside its region a sequence's slots equal its positions, so
all that concerns one sequence (its tree, walk, commit and drafter context) is what
`ddtree.engine.Engine` does for it alone. Only the forward passes are packed: the linear layers run once over every
row's tokens, and each row's attention reads its own slots with the meta it would have alone
(`layers.RowSpan`). Sequences join (`add`: the prompt's prefill) and leave (`remove`) between
rounds (a prompt of several prefill chunks may join a chunk a round, `add(defer=True)`, so that the
running sequences wait for one chunk at a time); each keeps its own tree shape, sampling, seed and
generator, so its tokens do not depend
on which sequences share its rounds (the tests check them against the single-sequence engine in
float32). Each row's committed length and next root token live on the device (`n`, `root`, with
`live` marking the rows that hold a sequence); `Sequence.n` and `root` are the host's copies, read
from each round's summary.

A round takes one of two paths:
- every sequence at one tree shape (the usual case under the batch's budget choice): the
  fixed-shape round of ddtree.batch_round, whose shapes depend only on (row bucket, budget, KV
  length), so that on CUDA its two halves (draft + build + verify, walk + commit) are CUDA graphs
  as `Engine`'s are; on the CPU the same functions run eagerly;
- mixed shapes: the per-row round, eager, each row's metas, tree, walk and commit made one by one
  around the packed forwards.

Fixed-shape rounds can be launched ahead (`launch`, then `collect`): `ddtree.batching` queues
round r + 1 before it reads round r, so that the host's work on round r's tokens (their text,
stop rules and streaming) runs while the device computes round r + 1, as `Engine`'s rounds
overlap. Round r + 1's KV length bounds each sequence's length by what round r may commit
(`lookahead`, the block, which every region has room for); a sequence that round r finishes, or
that leaves before round r + 1 is read, has that round's result dropped, and everything queued
after it (a new sequence's prefill into its freed region, a row's move) runs after it on the device.

A sequence's tree shape may change between rounds (`set_budget`: the batch's budget choice,
ddtree.batch_budget). Every shape is lossless and nothing of a round outlives it but the committed
entries, so the tokens stay the target's; the one thing a shape leaves behind is the drafter's
context, which an `ar` round would not feed. A sequence added with `feeds_drafter` has it fed in
every fixed-shape `ar` round (the batch's drafter call covers all rows at once); in a per-row round
it keeps the target features of its `ar` rounds' tokens and hands them to the drafter before it
next drafts (or once FEED_EVERY have gathered, which bounds their memory), so that it can draft in
any later round without paying a drafter call per `ar` round.

A hybrid target's recurrent layers keep one state per sequence, not per slot: each cache row has
its own (`row_states`, with conv windows) and its own verify stash (`row_scratch`, sized for the
largest tree run so far); a packed
forward runs each row's recurrent layers from its row's state (`RowSpan.recurrent`), a prefill
advancing it and a verify only reading it, and `commit_row` folds each row's accepted path in
(nothing for a row that is not live, so that padding rows and a capture's warm-up change no
state); a sequence moving rows takes its state along. One host sync per round reads every row's
acceptance length, kept tokens and bonus together; requests that ask for log-probs add one more.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ddtree.batch_round import UniformRounds, row_bucket
from ddtree.config import MAX_TREE_BUDGET, SamplingParams
from ddtree.engine import PREFILL_CHUNK, PREFILL_PAD_MAX, Step, prefill_chunks, prefill_lengths
from ddtree.kv_regions import SlotRegions
from ddtree.logprobs import as_token_logprobs, chosen_logprobs
from ddtree.models.layers import AttentionMeta, RowSpan
from ddtree.models.target import TargetModel
from ddtree.recurrent_state import HybridCache
from ddtree.sampling import choose_tokens
from ddtree.tree import Tree, build_chain, build_tree, single_node, walk
from ddtree.tree_shape import TreeShape

log = logging.getLogger("ddtree.batch_engine")

FEED_EVERY = 64  # tokens of `ar` rounds whose features a sequence gathers before they go to the drafter


@dataclass(eq=False)
class Sequence:
    """One request's decoding state: its cache row, committed length `n` (tokens whose KV entries
    are in place), the next root token (the last token emitted), its sampling and tree shape."""

    row: int  # its row of the batch: the R live sequences hold rows 0..R-1 (`BatchEngine.remove` keeps them so)
    first_slot: int  # its cache region: slots [first_slot, first_slot + slots)
    slots: int
    max_nodes: int  # the largest tree its region has room for
    params: SamplingParams
    budget: TreeShape
    generator: torch.Generator | None
    feeds_drafter: bool  # its committed tokens' target features go to the drafter's context
    n: int = 0
    root: int = 0
    in_flight: int = 0  # launched rounds of it whose summary is not read yet (`BatchEngine.launch`)
    removed: bool = False  # it left while a round of it was in flight: that round's result is dropped
    # Its `ar` rounds' tokens not yet in the drafter's context: (target features [1, F], position [1],
    # cache slot [1]) per round.
    unfed: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass(eq=False)
class FirstToken:
    """A joined sequence's first token, chosen on the device and not read yet (`BatchEngine.add`
    with read=False), with its log-probs' device tensors for a request that asks."""

    seq: Sequence
    token: torch.Tensor  # [] long
    logprobs: tuple | None


@dataclass(eq=False)
class LaunchedRound:
    """A fixed-shape round queued on the device (`BatchEngine.launch`): each sequence with its row
    at launch, the summary's handle (`UniformRounds.read`) and the log-probs of those that asked."""

    rows: list[tuple[Sequence, int]]
    budget: TreeShape
    handle: tuple
    logprobs: dict


@dataclass(eq=False)
class PendingPrefill:
    """A long prompt prefilled one chunk per round (`BatchEngine.add(defer=True)`): its sequence
    holds the first free row, not yet live, with the row's n at the tokens prefilled so far."""

    seq: Sequence
    tokens: torch.Tensor  # [P] the prompt
    chunks: list  # ddtree.engine.prefill_chunks(P, ...)
    done: int  # chunks run
    taps: list[int] | None


def longest_region(max_model_len: int, max_nodes: int, block_size: int) -> int:
    """The slots of a sequence at the context limit running trees of max_nodes nodes: its tokens,
    what one round launched ahead may commit past them (`BatchEngine.launch`), its tree or block,
    and the bonus slot."""
    return max_model_len + max(block_size, 1) + max(max_nodes, block_size) + 1


class BatchEngine:
    def __init__(self, target, drafter, max_model_len: int, max_rows: int, max_nodes: int | None = None,
                 cache_slots: int | None = None, prefill_chunk: int = PREFILL_CHUNK, use_graphs: bool | None = None, kv_bucket: int | None = None,
                 pad_rows: bool | None = None, compile_layers: bool | None = None, fused_tree: bool | None = None,
                 padded_prefill: bool | None = None, prefill_engine=None):
        """max_rows: sequences at once; max_nodes: the largest tree a sequence may use (default:
        that of the largest tree budget); cache_slots: the KV slots the sequences' regions share
        (default: max_rows regions of the longest, `row_slots`; at least one); prefill_chunk: the most tokens of a prompt one forward
        prefills (`ddtree.engine.prefill_chunks`). For the rounds whose rows share one tree shape
        (ddtree.batch_round): use_graphs (default: on CUDA) captures them as CUDA graphs; kv_bucket
        (default: 256 with graphs, else 1) rounds their KV length up; pad_rows (default: use_graphs)
        rounds their rows up to a row bucket (1, 2, 4, ..., max_rows), so that few graphs serve every
        row count; compile_layers (default: use_graphs), fused_tree (default: on CUDA) and
        padded_prefill (default: use_graphs: prompts padded to `engine.prefill_lengths`) as `Engine`'s.
        prefill_engine: an `Engine` of the same models and padded lengths (an `LLM`'s) that prefills
        the padded prompts, from its prefill graphs, into its own caches, whence they are copied
        into the row (`_prefill_through`): one replay instead of an eager forward a prompt."""
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        self.target, self.drafter = target, drafter
        self.max_model_len = max_model_len
        param = next(target.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = drafter.config.block_size if drafter is not None else 0
        self.feature_layers = drafter.config.target_layer_ids if drafter is not None else None
        self.feature_dim = len(self.feature_layers) * target.config.hidden_size if drafter is not None else 0
        self.max_nodes = max_nodes or MAX_TREE_BUDGET + 1
        # The most tokens one round commits: a sequence's committed length when a launched round's
        # summary is not read yet is at most this much past what the host knows.
        self.lookahead = max(self.block_size, 1)
        self.row_slots = longest_region(max_model_len, self.max_nodes, self.block_size)
        self.cache_slots = max_rows * self.row_slots if cache_slots is None else cache_slots
        if self.cache_slots < self.row_slots:
            raise ValueError(f"cache_slots={self.cache_slots} cannot hold one sequence at the context limit "
                             f"({self.row_slots} slots: max_model_len {max_model_len} and a tree of {self.max_nodes})")
        self.regions = SlotRegions(self.cache_slots)
        # Past the pool, the slots of every row no sequence holds: a round's padding rows (n = 0)
        # write their trees and blocks there, and read nothing any sequence wrote.
        self.spare_slot = self.cache_slots
        self.total_slots = self.cache_slots + self.span(self.max_nodes) + 1
        self.cache = target.new_cache(self.total_slots, self.device, self.dtype)
        self.hybrid = bool(getattr(target.config, "hybrid", False))
        self.kv = self.cache.kv if self.hybrid else self.cache  # the attention layers' KV
        if self.hybrid:
            # A hybrid target's recurrent layers: each cache row's own state and conv windows (row
            # 0's are the cache's), and the stash its verify leaves for the commit (`ensure_scratch`).
            self.row_states = [self.cache.recurrent] + [target.new_recurrent_state(self.device, self.dtype)
                                                        for _ in range(max_rows - 1)]
            self.row_caches = [HybridCache(self.kv, state) for state in self.row_states]
        self.row_scratch: list = []
        self.draft_cache = None
        self.draft_noise = None
        if drafter is not None:
            drafter.fuse_projections()
            self.draft_cache = drafter.new_cache(self.total_slots, self.device, self.dtype)
            mask = torch.full((self.block_size,), drafter.config.mask_token_id, dtype=torch.long, device=self.device)
            with torch.no_grad():  # the block's b - 1 mask tokens, which never change (as `Engine`)
                self.draft_noise = target.embed_tokens(mask) * drafter.config.input_embedding_scale
        # The acceptance rule (as `Engine.walk_fn`: tests replace it), on one tree or stacked rows' trees.
        self.walk_fn = walk
        self.max_rows = max_rows
        self.sequences: list[Sequence] = []
        self.pending: PendingPrefill | None = None  # a long prompt prefilled a chunk a round (`add(defer=True)`)
        # Per cache row, on the device: the committed length, the next root token and whether a
        # sequence holds the row. Rounds read and advance them there; `Sequence.n` / `root` are the
        # host's copies, read from each round's summary. A free row's n is 0.
        self.n = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.root = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        self.live = torch.zeros(max_rows, dtype=torch.bool, device=self.device)
        # Each row's first cache slot (its sequence's region; the spare slots for a free row) on the
        # device, which the rounds' attention, KV writes and commits add to positions, and the host's copy.
        self.first_slot = torch.full((max_rows,), self.spare_slot, dtype=torch.long, device=self.device)
        self.row_first_slots = [self.spare_slot] * max_rows
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        if isinstance(target, TargetModel):
            target.fold_norms_if_asked()
        if self.use_graphs if compile_layers is None else compile_layers:
            target.use_compiled()
            if drafter is not None:
                drafter.use_compiled()
        self.kv_bucket = kv_bucket or (256 if self.use_graphs else 1)
        pad = self.use_graphs if padded_prefill is None else padded_prefill
        self.prefill_lengths = prefill_lengths(min(PREFILL_PAD_MAX, max_model_len)) if pad else []
        if prefill_engine is not None and prefill_engine.prefill_lengths != self.prefill_lengths:
            raise ValueError("the prefill engine must pad prompts to the same lengths")
        self.prefill_engine = prefill_engine
        self.pad_rows = self.use_graphs if pad_rows is None else pad_rows
        fused_tree = (self.device.type == "cuda") if fused_tree is None else fused_tree
        self.rounds = UniformRounds(self, self.use_graphs, fused_tree)

    @property
    def free_rows(self) -> int:
        """Rows a sequence can join now: none while a deferred prefill holds the first free row."""
        return 0 if self.pending is not None else self.max_rows - len(self.sequences)

    def span(self, nodes: int) -> int:
        """Slots past a sequence's committed tokens that a round of `nodes` tree nodes writes (its
        tree, or the drafter's block)."""
        return max(nodes, self.block_size)

    def region_slots(self, prompt_len: int, max_new: int | None = None, max_nodes: int | None = None) -> int:
        """The region a sequence of `prompt_len` prompt tokens, up to max_new more (default: to the
        context limit) and trees of up to max_nodes nodes (default: the engine's largest) holds."""
        tokens = self.max_model_len if max_new is None else min(prompt_len + max_new, self.max_model_len)
        return tokens + self.lookahead + self.span(self.max_nodes if max_nodes is None else max_nodes) + 1

    def fits(self, prompt_len: int, max_new: int | None = None, max_nodes: int | None = None) -> bool:
        """Whether such a sequence can join now (a free row and a free region for it)."""
        return bool(self.free_rows) and self.regions.largest_free >= self.region_slots(prompt_len, max_new, max_nodes)

    # -- joining and leaving -------------------------------------------------------------------

    @torch.inference_mode()
    def add(self, prompt: list[int], params: SamplingParams, budget: TreeShape,
            feeds_drafter: bool | None = None, defer: bool = False, max_new: int | None = None,
            max_nodes: int | None = None, read: bool = True) -> tuple[Sequence, "Step | FirstToken | None"]:
        """Prefill `prompt` into a free row -> (its sequence, the step of its first token). Its
        region (`region_slots`) has room for max_new more tokens (default: to the context limit;
        the rounds past them are the caller's to stop) and trees of up to max_nodes nodes (default:
        the engine's largest; `set_budget` keeps under it). feeds_drafter: keep the drafter's context whatever the budget (default: when it drafts),
        for a sequence whose budget may change (`set_budget`). defer: a prompt of more than one
        prefill chunk has only its first chunk prefilled now, and the rest one chunk a call of
        `advance_prefill` (between rounds, so that the running sequences wait for one chunk at a
        time, not the whole prompt); the step is then None, and `advance_prefill` returns it.
        read=False: the first token stays on the device (a `FirstToken`), read with others' by
        `first_steps`, which must come before the next round's events are read."""
        if not self.free_rows:
            raise RuntimeError("every row is in use; remove a sequence first")
        feeds_drafter = budget.drafts if feeds_drafter is None else feeds_drafter
        if feeds_drafter and self.drafter is None:
            raise ValueError("tree budgets other than 'ar' need a drafter")
        max_nodes = self.max_nodes if max_nodes is None else max_nodes
        if max_nodes > self.max_nodes:
            raise ValueError(f"max_nodes={max_nodes}: this engine holds trees of at most {self.max_nodes} nodes")
        self._check_nodes(budget, max_nodes)
        if not 0 < len(prompt) < self.max_model_len:
            raise ValueError(f"a prompt of {len(prompt)} tokens does not fit the context limit of {self.max_model_len}")
        if max_new is not None and max_new < 1:
            raise ValueError(f"max_new must be >= 1, got {max_new}")
        slots = self.region_slots(len(prompt), max_new, max_nodes)
        first = self.regions.allocate(slots)
        if first is None:
            raise RuntimeError(f"no free cache region of {slots} slots (the largest is {self.regions.largest_free}); "
                               "remove a sequence first")
        generator = None
        if not params.greedy:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,))))
        row = len(self.sequences)  # the first free row
        seq = Sequence(row, first, slots, max_nodes, params, budget, generator, feeds_drafter)
        self._place(seq, row)
        if defer and self._chunked(prompt) and len(prompt) > self.prefill_chunk:
            tokens = torch.tensor(prompt, dtype=torch.long, device=self.device)
            chunks = prefill_chunks(len(prompt), self.prefill_chunk, self.device)
            self.pending = PendingPrefill(seq, tokens, chunks, 0, self.feature_layers if feeds_drafter else None)
            self.advance_prefill()
            return seq, None
        return seq, self._start(seq, len(prompt), self._prefill(seq, prompt), read)

    @torch.inference_mode()
    def advance_prefill(self) -> tuple[Sequence, Step] | None:
        """The deferred prefill's next chunk; after its last, the sequence goes live -> (it, the
        step of its first token); None before that, or when no prefill is deferred."""
        pending = self.pending
        if pending is None:
            return None
        rows, alone, last = pending.chunks[pending.done]
        logits = self._prefill_chunk(pending.seq, pending.tokens[rows], alone, last, pending.taps)
        pending.done += 1
        # The row's n is the tokens in place: what a round's padding row over it writes lands past them.
        self.n[pending.seq.row].fill_(rows.stop)
        pending.seq.n = rows.stop
        if pending.done < len(pending.chunks):
            return None
        self.pending = None
        return pending.seq, self._start(pending.seq, pending.tokens.shape[0], logits)

    def _start(self, seq: Sequence, prompt_len: int, logits: torch.Tensor, read: bool = True) -> "Step | FirstToken":
        """A prefilled sequence goes live: its first token chosen from the prompt's last logits, on
        the device -> its Step (read: one host sync), or the token still on the device (`first_steps`)."""
        row, params = seq.row, seq.params
        first = choose_tokens(logits, params, seq.generator)[0]
        self.n[row].fill_(prompt_len)
        self.root[row].copy_(first)
        self.live[row].fill_(True)
        seq.n = prompt_len
        self.sequences.append(seq)
        values = None if params.logprobs is None else chosen_logprobs(logits, first.reshape(1), params.logprobs)
        token = FirstToken(seq, first, values)
        return self.first_steps([token])[0] if read else token

    def first_steps(self, tokens: list["FirstToken"]) -> list[Step]:
        """The Steps of sequences added with read=False, their first tokens read in one host sync
        (so that several joining sequences' prefills queue on the device back to back)."""
        values = torch.stack([t.token for t in tokens]).tolist()  # host sync: the first tokens are needed now
        steps = []
        for token, value in zip(tokens, values):
            token.seq.root = value
            logprobs = None
            if token.logprobs is not None:
                logprobs = as_token_logprobs([value], *(t.tolist() for t in token.logprobs))
            steps.append(Step([value], 0, logprobs))
        return steps

    def set_budget(self, seq: Sequence, budget: TreeShape) -> None:
        """The tree shape of `seq`'s next rounds (a drafting one only for a sequence that feeds the
        drafter)."""
        if budget.drafts and not seq.feeds_drafter:
            raise ValueError(f"tree budget {budget} drafts, and this sequence was added without the drafter's "
                             "context (add it with feeds_drafter=True)")
        self._check_nodes(budget, seq.max_nodes)
        seq.budget = budget

    def _check_nodes(self, budget: TreeShape, max_nodes: int | None = None) -> None:
        max_nodes = self.max_nodes if max_nodes is None else max_nodes
        if budget.nodes(self.block_size) > max_nodes:
            raise ValueError(f"tree budget {budget} needs {budget.nodes(self.block_size)} nodes; "
                             f"this {'sequence' if max_nodes < self.max_nodes else 'engine'} holds at most {max_nodes}")

    @torch.inference_mode()
    def remove(self, seq: Sequence) -> None:
        """The sequence leaves and its region is freed. The sequence in the last live row moves into
        its row, so that the live rows stay 0..R-1 (a round of R rows is then always the round of
        rows 0..R-1); the last row becomes free, with n = 0, over the spare slots. Stale entries are
        never read: a sequence reads only slots it has written. A round of it still in flight
        finishes on the device before anything queued later (a new sequence's prefill into the freed
        region, a row's move) runs, and its result is dropped (`collect`)."""
        self.regions.release(seq.first_slot)
        seq.removed = True
        if self.pending is not None and seq is self.pending.seq:  # its prefill is dropped
            self.pending = None
            free = seq.row
        else:
            self.sequences.remove(seq)
            last = next((s for s in self.sequences if s.row == len(self.sequences)), None)
            if last is not None:
                self._move(last, seq.row)
            free = len(self.sequences)
            if self.pending is not None:  # a deferred prefill keeps the first free row
                self._move(self.pending.seq, free)
                free += 1
        self.n[free].zero_()
        self.root[free].zero_()
        self.live[free].fill_(False)
        self.first_slot[free].fill_(self.spare_slot)
        self.row_first_slots[free] = self.spare_slot

    def _place(self, seq: Sequence, row: int) -> None:
        """Point `row` at seq's region."""
        seq.row = row
        self.first_slot[row].fill_(seq.first_slot)
        self.row_first_slots[row] = seq.first_slot

    def _move(self, seq: Sequence, row: int) -> None:
        """Move `seq` into the free `row`: its device n, root and first slot (its region and KV
        entries stay where they are) and a hybrid's recurrent state and conv windows, which are the
        row's."""
        if self.hybrid:
            self.row_states[row].copy_from(self.row_states[seq.row])
        self.n[row].copy_(self.n[seq.row])
        self.root[row].copy_(self.root[seq.row])
        self._place(seq, row)

    def _prefill(self, seq: Sequence, prompt: list[int]) -> torch.Tensor:
        """The prompt's forwards into the row -> logits [1, V] of its last token (float32); the
        drafter's context too, for a sequence that feeds it. A prompt of up to the longest of
        `prefill_lengths` is padded to the next of them, in one forward, as `Engine`'s: a few shapes
        for every prompt length, so that what a shape costs the first time (compiled functions,
        kernel plans) is paid once per length, not once per prompt. Longer prompts go in chunks
        (`prefill_chunks`)."""
        taps = self.feature_layers if seq.feeds_drafter else None
        if not self._chunked(prompt):
            if self.prefill_engine is not None:
                return self._prefill_through(self.prefill_engine, seq, prompt)
            length = next(x for x in self.prefill_lengths if x >= len(prompt))
            return self._padded_prefill(seq, prompt, length, taps)
        tokens = torch.tensor(prompt, dtype=torch.long, device=self.device)
        for rows, alone, last in prefill_chunks(len(prompt), self.prefill_chunk, self.device):
            logits = self._prefill_chunk(seq, tokens[rows], alone, last, taps)
        return logits

    def _chunked(self, prompt: list[int]) -> bool:
        """Whether `prompt` is prefilled at its exact length in chunks (beyond the padded lengths)."""
        return not self.prefill_lengths or len(prompt) > self.prefill_lengths[-1]

    def _prefill_chunk(self, seq: Sequence, tokens: torch.Tensor, alone: AttentionMeta, last: slice,
                       taps: list[int] | None) -> torch.Tensor:
        """One of `prefill_chunks`' forwards (tokens [c] at alone.write_slots) into seq's row -> its
        logits of rows `last`; the drafter's context too, with `taps`."""
        positions = alone.write_slots
        meta = self._packed(positions + seq.first_slot, [(seq, slice(0, positions.shape[0]), alone)], states=True)
        logits, features = self.target(tokens, positions, meta, self.cache, taps, logit_rows=last)
        if features is not None:
            self.drafter.append_context(features, positions, self.draft_cache, slots=positions + seq.first_slot)
        return logits

    def _padded_prefill(self, seq: Sequence, prompt: list[int], length: int, taps: list[int] | None) -> torch.Tensor:
        """The prompt padded to `length` tokens in one causal forward: the padding writes only slots
        past n of the row (scratch, rewritten before any query reads it), and a hybrid's recurrent
        layers stop at n."""
        p = len(prompt)
        tokens = torch.tensor(prompt + [0] * (length - p), dtype=torch.long).to(self.device)
        positions = torch.arange(length, device=self.device)
        n = torch.tensor(p, device=self.device)
        alone = AttentionMeta(positions, length, None, causal=True, length=n)
        meta = self._packed(positions + seq.first_slot, [(seq, slice(0, length), alone)], states=True)
        logits, features = self.target(tokens, positions, meta, self.cache, taps, logit_rows=(n - 1).reshape(1))
        if features is not None:
            self.drafter.append_context(features, positions, self.draft_cache, slots=positions + seq.first_slot)
        return logits

    def _prefill_through(self, engine, seq: Sequence, prompt: list[int]) -> torch.Tensor:
        """The padded prefill run by `engine` (`Engine.prefill_padded`: a graph replay with graphs,
        where this engine's own padded prefill is an eager forward: 5.8 against 0.5 ms a prompt on
        the H200 with the demo pair, batch_first_token_h200_demo.json), then its entries copied
        into the row: the target's KV and a hybrid's state and conv window, the drafter's context
        for a sequence that feeds it. The same forward as `Engine`'s -> the same logits as a solo run."""
        logits = engine.prefill_padded(prompt)
        p = len(prompt)
        self.kv.copy_span(0, seq.first_slot, p, source=engine.cache.kv if self.hybrid else engine.cache)
        if self.hybrid:
            self.row_states[seq.row].copy_from(engine.cache.recurrent)
        if seq.feeds_drafter:
            self.draft_cache.copy_span(0, seq.first_slot, p, source=engine.draft_cache)
        return logits

    def _packed(self, write_slots: torch.Tensor, rows: list[tuple[Sequence, slice, AttentionMeta]],
                states: bool = False) -> AttentionMeta:
        """The meta of a packed forward: every row's (sequence, its tokens' rows, its meta alone);
        `states`: a target forward, whose hybrid recurrent layers run each row from its own state."""
        kv_len = max(seq.first_slot + alone.kv_len for seq, _, alone in rows)
        return AttentionMeta(write_slots, kv_len, rows=[
            RowSpan(tokens, seq.first_slot, alone, self.row_states[seq.row] if states and self.hybrid else None)
            for seq, tokens, alone in rows])

    # -- a round -------------------------------------------------------------------------------

    def _kv_len(self, seq: Sequence) -> int:
        """Slots of its row a round of `seq` reads: its context, then its tree or block (as `Engine`)."""
        needed = seq.n + seq.in_flight * self.lookahead + self.span(seq.budget.nodes(self.block_size))
        if needed > seq.slots:
            raise ValueError(f"a sequence of {seq.n} tokens has no room in its {seq.slots} slots for a round of "
                             f"tree budget {seq.budget}")
        return needed

    def _draft(self, seqs: list[Sequence]) -> list[torch.Tensor]:
        """One drafter pass over every drafting sequence's block -> their draft logits [b - 1, V]."""
        b = self.block_size
        noise, positions, slots, metas = [], [], [], {}
        for i, seq in enumerate(seqs):
            root = torch.tensor([seq.root], device=self.device)
            block = self.draft_noise.clone()
            block[:1] = self.target.embed_tokens(root) * self.drafter.config.input_embedding_scale
            noise.append(block)
            n = torch.tensor(seq.n, device=self.device)
            alone = self.drafter.block_metas(n, b, self._kv_len(seq))
            for kind, meta in alone.items():
                metas.setdefault(kind, []).append((seq, slice(i * b, (i + 1) * b), meta))
            positions.append(alone["full"].write_slots)
            slots.append(alone["full"].write_slots + seq.first_slot)
        slots = torch.cat(slots)
        packed = {kind: self._packed(slots, rows) for kind, rows in metas.items()}
        hidden = self.drafter(torch.cat(noise), packed, self.draft_cache, positions=torch.cat(positions))
        drafted = hidden.view(len(seqs), b, -1)[:, 1:].reshape(len(seqs) * (b - 1), -1)
        return list(self.drafter.logits(drafted, self.target.lm_head).split(b - 1))

    def _tree(self, seq: Sequence, draft_logits: torch.Tensor | None) -> Tree:
        root = torch.tensor(seq.root, device=self.device)
        if not seq.budget.drafts:
            return single_node(root)
        if not seq.budget.builds_tree:  # the chain: each depth's argmax
            return build_chain(torch.argmax(draft_logits, dim=-1), root)
        return build_tree(F.log_softmax(draft_logits, dim=-1), root, seq.budget.budget)

    def _feed(self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        """Append committed tokens' (target features, positions, slots) to the drafter's context, in one call."""
        if parts:
            feats, positions, slots = (torch.cat(p) for p in zip(*parts))
            self.drafter.append_context(feats, positions, self.draft_cache, slots=slots)

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, Step]]:
        """One round of every sequence: draft, build, verify (packed), then each sequence's choice,
        walk and commit -> each sequence's Step, in `sequences` order. When every sequence has the
        same tree shape, the fixed-shape round (ddtree.batch_round), else the per-row round."""
        seqs = list(self.sequences)
        if not seqs:
            return []
        if self.uniform:
            return self.collect(self.launch())
        return self._mixed_step(seqs)

    @property
    def uniform(self) -> bool:
        """Whether the sequences' next round is the fixed-shape one (every sequence at one shape)."""
        return all(seq.budget == self.sequences[0].budget for seq in self.sequences)

    @torch.inference_mode()
    def launch(self) -> "LaunchedRound":
        """Queue the fixed-shape round (ddtree.batch_round) of every sequence (all at one tree shape:
        `uniform`) without waiting for the device; `collect` reads it. A round may be launched before
        the previous one is collected, so that the host's work on a round's tokens (text, stop
        rules, streaming) runs while the device computes the next: its KV length then bounds each
        sequence's length by what the unread round may add (`lookahead`), and a sequence that turns
        out to have finished in the unread round runs one round more, whose result is dropped."""
        seqs = list(self.sequences)
        if not seqs or not self.uniform:
            raise RuntimeError("a launched round needs sequences at one tree shape")
        budget = seqs[0].budget
        self._feed_unfed(seqs)  # here `ar` rounds feed the drafter as they go: the context whole first
        kv_len = self._bucketed_kv_len(max(self._kv_len(seq) for seq in seqs))
        rows = row_bucket(len(seqs), self.max_rows) if self.pad_rows else len(seqs)
        handle, logprobs = self.rounds.launch(seqs, rows, budget, kv_len)
        for seq in seqs:
            seq.in_flight += 1
        return LaunchedRound([(seq, seq.row) for seq in seqs], budget, handle, logprobs)

    @torch.inference_mode()
    def collect(self, launched: "LaunchedRound") -> list[tuple[Sequence, Step]]:
        """Wait for a launched round -> the Step of each of its sequences that has not left since,
        in launch order; their host n and root advance."""
        summaries = self.rounds.read(launched.handle)
        steps = []
        for seq, row in launched.rows:  # each sequence's row when launched (a row may have changed hands since)
            seq.in_flight -= 1
            if not seq.removed:
                steps.append((seq, self._commit(seq, summaries[row], launched.logprobs.get(id(seq)), launched.budget)))
        return steps

    def _bucketed_kv_len(self, needed: int) -> int:
        """The KV length a fixed-shape round that reads `needed` slots of each row runs at."""
        return min(-(-needed // self.kv_bucket) * self.kv_bucket, self.row_slots)

    def uniform_kv_lens(self, budget: TreeShape) -> list[int]:
        """Every KV length a fixed-shape round of `budget` can run at: from a sequence of one
        committed token to one at the context limit."""
        span = self.span(budget.nodes(self.block_size))
        first = self._bucketed_kv_len(1 + span)
        last = self._bucketed_kv_len(self.max_model_len + self.lookahead + span)
        return sorted({*range(first, last, self.kv_bucket), last})

    @torch.inference_mode()
    def capture_all(self, budgets: list[TreeShape]) -> int:
        """With graphs, capture now every graph the fixed-shape rounds of `budgets` can replay (each
        row bucket, each KV length; for `ar`, rows that feed the drafter and rows that do not) and
        the prefill engine's prefill graphs, so
        that no request waits for a capture while serving -> how many were captured. Call with no
        sequences: the warm-ups then write only free rows' slots."""
        if not self.use_graphs:
            return 0
        if self.sequences or self.pending is not None:
            raise RuntimeError("graphs are captured ahead on an engine with no sequences")
        start, count = time.perf_counter(), 0
        if self.prefill_engine is not None:  # the padded prompts' prefill graphs
            count += self.prefill_engine.capture_prefills()
        self.ensure_scratch(max(budget.nodes(self.block_size) for budget in budgets))  # grown once, first
        buckets = sorted({row_bucket(r, self.max_rows) for r in range(1, self.max_rows + 1)}) if self.pad_rows \
            else list(range(1, self.max_rows + 1))
        for budget in budgets:
            self._check_nodes(budget)
            feeds = {self.drafter is not None and (budget.drafts or f) for f in (True, False)}
            for rows in buckets:
                for feed in sorted(feeds):
                    count += self.rounds.capture_all(rows, budget, feed, self.uniform_kv_lens(budget))
        log.info("captured %d batched graphs (tree budgets %s, %d row buckets) in %.1f s", count,
                 ", ".join(map(str, budgets)), len(buckets), time.perf_counter() - start)
        return count

    def _feed_unfed(self, seqs: list[Sequence]) -> None:
        """The unfed `ar` tokens of `seqs` into the drafter's context, in one call."""
        self._feed([part for seq in seqs for part in seq.unfed])
        for seq in seqs:
            seq.unfed.clear()

    def _mixed_step(self, seqs: list[Sequence]) -> list[tuple[Sequence, Step]]:
        """The per-row round, for sequences of different tree shapes: each row's draft metas, tree,
        walk and commit made one by one around the packed forwards."""
        if any(seq.in_flight for seq in seqs):  # it reads and writes the host's lengths, exact only then
            raise RuntimeError("collect the launched rounds before a per-row round")
        drafting = [s for s in seqs if s.budget.drafts]
        self._feed_unfed(drafting)  # their context whole before they draft
        drafts = dict(zip(map(id, drafting), self._draft(drafting))) if drafting else {}
        trees = [self._tree(seq, drafts.get(id(seq))) for seq in seqs]
        self.ensure_scratch(max(tree.size for tree in trees))

        # The verify: every tree in one forward, each row seeing its context and its ancestors.
        rows, start = [], 0
        for seq, tree in zip(seqs, trees):
            n = torch.tensor(seq.n, device=self.device)
            slots = n + torch.arange(tree.size, device=self.device)
            alone = AttentionMeta(slots, self._kv_len(seq), prefix_len=n, block_mask=tree.visible,
                                  **self.recurrent_tree(seq.row, tree.parents, tree.depths))
            rows.append((seq, slice(start, start + tree.size), alone))
            start += tree.size
        write_slots = torch.cat([alone.write_slots + seq.first_slot for seq, _, alone in rows])
        tokens = torch.cat([tree.tokens for tree in trees])
        positions = torch.cat([tree.depths + seq.n for seq, tree in zip(seqs, trees)])
        taps = self.feature_layers if any(seq.feeds_drafter for seq in seqs) else None
        logits, features = self.target(tokens, positions, self._packed(write_slots, rows, states=True), self.cache,
                                       taps)

        summaries, kept_logprobs, context = [], {}, []
        for (seq, span, _), tree in zip(rows, trees):
            row_logits = logits[span]
            choices = choose_tokens(row_logits, seq.params, seq.generator)
            result = self.walk_fn(tree, choices)
            keep = min(tree.size, self.block_size or 1)
            kept = result.order[:keep]
            self.commit_row(seq.row, seq.first_slot + seq.n, kept, result.length, tree.size)
            if seq.feeds_drafter:  # the kept nodes' features become the drafter's context
                positions = seq.n + torch.arange(keep, device=self.device)
                fed = (features[span][kept], positions, positions + seq.first_slot)
                if seq.budget.drafts:
                    context.append(fed)
                else:  # until it drafts: one drafter call for many `ar` rounds
                    seq.unfed.append(fed)
                    if len(seq.unfed) >= FEED_EVERY:  # an `ar` round commits one token
                        context += seq.unfed
                        seq.unfed = []
            summaries.append(torch.cat([result.length.reshape(1), tree.tokens[kept], result.bonus.reshape(1)]))
            if seq.params.logprobs is not None:  # the target's log-probs of its choices at the kept nodes
                kept_logprobs[id(seq)] = chosen_logprobs(row_logits[kept], choices[kept], seq.params.logprobs)
        self._feed(context)

        # The round's one host sync: every row's acceptance length, kept tokens and bonus.
        flat = torch.cat(summaries).tolist()
        steps, at = [], 0
        for seq, tree in zip(seqs, trees):
            keep = min(tree.size, self.block_size or 1)
            steps.append((seq, self._commit(seq, flat[at:at + keep + 2], kept_logprobs.get(id(seq)))))
            at += keep + 2
        self._store_rows()
        return steps

    def ensure_scratch(self, nodes: int) -> None:
        """A hybrid's per-row verify stash for trees of `nodes` nodes: every budget and row bucket
        shares one per cache row, sized for the largest tree that has run (2.4 MiB per node and
        row at Qwen3.6-27B shape), not the largest a request may name. Growing it drops the
        captured graphs, which hold the old stash's addresses (it happens once per larger budget)."""
        if not self.hybrid or (self.row_scratch and self.row_scratch[0].nodes >= nodes):
            return
        if self.device.type == "cuda":  # a launched round may still use the old stash and graphs
            torch.cuda.synchronize()  # intentional: once per larger budget
        self.row_scratch = [self.target.new_scratch(nodes, self.device, self.dtype) for _ in range(self.max_rows)]
        self.rounds.drop_graphs()

    def recurrent_tree(self, row: int, parents: torch.Tensor, depths: torch.Tensor) -> dict:
        """A tree verify's meta fields for a hybrid's recurrent layers (the tree's shape and the
        row's stash); none for a dense target."""
        return dict(parents=parents, depths=depths, scratch=self.row_scratch[row]) if self.hybrid else {}

    def commit_rows(self, starts: torch.Tensor, kept: torch.Tensor, lengths: torch.Tensor, nodes: int) -> None:
        """`commit_row` for cache rows 0..R-1 at once: starts [R] (each row's first slot plus n),
        kept [R, K], lengths [R] (0 on padding rows). A dense target's rows are one compaction;
        a hybrid's recurrent states go row by row."""
        if self.hybrid:
            for row in range(kept.shape[0]):
                self.commit_row(row, starts[row], kept[row], lengths[row], nodes)
        elif nodes > 1:  # one node's entries are already in place at slot n
            self.kv.compact(starts, kept)

    def commit_row(self, row: int, start, kept: torch.Tensor, length, nodes: int) -> None:
        """After a row's walk: its kept nodes' KV entries into place from slot `start` (its first
        slot plus n) and, for a hybrid target, its recurrent state advanced by the path's `length`
        nodes (a device tensor; 0 leaves it, as for padding rows)."""
        if self.hybrid:
            self.target.commit(self.row_caches[row], start, kept, length, self.row_scratch[row])
        elif nodes > 1:  # one node's entries are already in place at slot n
            self.kv.compact(start, kept)

    def _commit(self, seq: Sequence, summary: list[int], kept_logprobs: tuple | None,
                budget: TreeShape | None = None) -> Step:
        """The host's side of a round of `seq` at `budget` (default: its own): its summary [a, kept
        tokens, bonus] (and the log-probs at its kept nodes, for a request that asks) -> its Step;
        n and root advance."""
        a = summary[0]
        emitted = summary[2:1 + a] + [summary[-1]]
        seq.n += a
        seq.root = summary[-1]
        logprobs = None
        if kept_logprobs is not None:  # a second sync, for requests that ask for log-probs only
            values, top_values, top_ids = (t[:a].tolist() for t in kept_logprobs)
            logprobs = as_token_logprobs(emitted, values, top_values, top_ids)
        return Step(emitted, a, logprobs, budget or seq.budget)

    def _store_rows(self) -> None:
        """Every live row's n and root from the host's copies onto the device (after a per-row
        round, which reads and advances the host's)."""
        rows = sorted(self.sequences, key=lambda seq: seq.row)
        values = torch.tensor([[seq.n for seq in rows], [seq.root for seq in rows]], dtype=torch.long)
        self.n[:len(rows)].copy_(values[0])
        self.root[:len(rows)].copy_(values[1])
