"""The tree build of one round as four Triton kernels: rank (two), select, visibility.

`ddtree.tree.build_tree` does the same work as ~10 PyTorch operators per depth level (a `topk`
over B x B candidates each time); on a small target that is most of a round. Here:

- rank: the best K = min(B, V) tokens of each depth, ties by token id (unique int64 keys). Two
  forms. "filter" (three launches): the largest key of each of G >= 2 K groups of the vocabulary
  (grid: depths x chunks); then each chunk keeps only its keys at or above the KP-th largest
  group maximum (at least KP keys of the depth reach it, so every key of the depth's best K does)
  and appends them to the depth's list, or, where more than KP pass, its own best KP (grid:
  depths x chunks); then the best K of that list, usually a few K keys (grid: depths).
  "chunks" (two launches): the best KP of every chunk, then of the chunks' heads, each by a
  bitonic top-k (`_best`) or, where K is large enough for it to pay, a radix select over the
  block in registers (`_radix_best`; `RADIX_MIN_K`);
- select (one program per tree): the level-by-level top-B of `build_tree`, then the global top-B, node
  numbering, parents, depths and tokens, written straight into the round's buffers. Candidate
  (parent rank i, token rank j) can only be among a level's best B when (i + 1)(j + 1) <= B (that
  many candidates beat or tie it with a smaller position), so each level takes the top B of ~B ln B
  keys, not of B^2. A level's scores stay in registers for the next level (read back from its
  keys, no trip through memory), and a running global top-B is merged level by level. The next
  level's best node is known before it is built (the best parent plus the best token, both rank
  0), so when it falls below the running B-th best, that level and every deeper one (a child
  never beats its parent) are skipped: a shallow tree builds only the levels it has;
- visibility (grid: row blocks): each row's ancestors, by following parent pointers.

A batched round builds every row's tree in the same launches: the rank grids run over rows x
depths, select and visibility gain a row axis (`TreeBuildPlan(rows=R)`).

The output equals `build_tree` exactly (tests run both on random and tie-heavy inputs, on the GPU
and, through Triton's interpreter, on the CPU). Keys are the same as `ddtree.tree.order_keys`:
the float's order-preserving 32 bits, then the position inverted in the low bits.
"""
from __future__ import annotations

import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no Triton: `build_tree` is used instead
    triton = None

MAX_SORT = 8192  # the largest key block one program sorts (registers, not a correctness limit)
# The least KP (K rounded up to a power of two) at which each rank launch takes the radix select
# instead of the bitonic top-k. H200, Qwen3's vocabulary, 15 depths, us per launch, bitonic / radix
# (benchmarks/README.md, "The rank kernels' radix select"): chunks 38 / 89 at K = 16, 74 / 103 at
# 64, 185 / 144 at 256; merge 14 / 20, 46 / 37, 88 / 35.
RADIX_MIN_K = {"chunks": 256, "merge": 64}
RANKS = ("auto", "radix", "bitonic", "filter")
# The rank's form where a plan is given none (the engines' plans): DDTREE_TREE_RANK, one of RANKS.
# "filter" by default: on an H100 at Qwen3's vocabulary and 15 depths the whole build took 41.7 /
# 49.4 / 96.3 us at budgets 16 / 64 / 256 against 61.8 / 113.9 / 213.9 with the chunks' rank
# (benchmarks/README.md, "The tree build's rank through a threshold").
DEFAULT_RANK = os.environ.get("DDTREE_TREE_RANK", "filter")


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def candidates(budget: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent rank i, token rank j) pairs with i < budget, j < k and (i + 1)(j + 1) <= budget,
    in position order (i * k + j ascending): the only ones that can be among a level's best B."""
    pairs = [(i, j) for i in range(budget) for j in range(min(k, budget // (i + 1)))]
    i, j = zip(*pairs)
    return torch.tensor(i, dtype=torch.int32), torch.tensor(j, dtype=torch.int32)


class TreeBuildPlan:
    """Static shapes and scratch of one (budget, depth count, vocabulary) on one device, for up to
    `rows` trees at once."""

    def __init__(self, budget: int, depth_count: int, vocab: int, device, selection: str = "topk",
                 rank_warps: int = 8, select_warps: int | None = None, rows: int = 1, rank: str | None = None):
        """selection: "topk" (`tl.topk`, the default: 1.3-2.9x faster than "sort" on an H200 at
        budgets 16-256, benchmarks/README.md) or "sort" (a full bitonic sort per selection, kept as
        a cross-check). benchmarks/tree_build.py times both; both give the same tree.
        rank_warps / select_warps: warps per program of the rank kernels and of select (None:
        by select's largest block); benchmarks/tree_build.py --rank-warps / --select-warps times them.
        rows: the most trees one `build` makes (a batched round's rows); the scratch is sized for them.
        rank: how the depths' best K are found: "filter" (group maxima, a threshold and a short
        list: the module docstring), or the chunks' heads merged, each block's best keys taken by
        "auto" (each launch by `RADIX_MIN_K`), "radix" (`_radix_best`) or "bitonic" (`_best` with
        this selection) in both; None: `DEFAULT_RANK`."""
        rank = DEFAULT_RANK if rank is None else rank
        if selection not in ("sort", "topk"):
            raise ValueError(f"selection must be 'sort' or 'topk', got {selection!r}")
        if rank not in RANKS:
            raise ValueError(f"rank must be one of {', '.join(map(repr, RANKS))}, got {rank!r}")
        self.filter = rank == "filter"
        self.budget, self.depth_count, self.vocab, self.rows = budget, depth_count, vocab, rows
        self.topk = selection == "topk"
        self.k = min(budget, vocab)
        self.kp = max(2, _pow2(self.k))  # block sizes >= 2: `tl.topk` cannot reduce to one element
        self.radix = {launch: rank == "radix" or (rank == "auto" and self.kp >= least)
                      for launch, least in RADIX_MIN_K.items()}
        self.chunk = max(self.kp, min(1024, _pow2(vocab)), _pow2(math.ceil(vocab * self.kp / MAX_SORT)))
        self.chunks = math.ceil(vocab / self.chunk)
        self.merge = _pow2(self.chunks) * self.kp
        # "filter": groups of `group` tokens, at least 2 KP of them (where the vocabulary allows),
        # whose maxima set the threshold; the last launch reads the list `short` keys at a time.
        self.group = min(self.chunk, _pow2_floor(vocab // (2 * self.kp)))
        self.groups = self.chunks * (self.chunk // self.group)
        self.short = min(self.merge, max(4 * self.kp, 256))
        cand_i, cand_j = candidates(budget, self.k)
        self.cand_count = cand_i.numel()
        self.budget_pad = max(2, _pow2(budget))
        self.cand_pad = max(self.budget_pad, _pow2(self.cand_count))
        self.supported = triton is not None and max(self.chunk, self.merge, self.cand_pad, _pow2(self.groups)) <= MAX_SORT
        # H200, demo vocabulary (benchmarks/README.md, tree build): 4 warps best at budget 32
        # (256 candidate keys), 8 at 64 and 128 (512, 1024); 16 at 256 (Qwen3 vocabulary).
        self.select_warps = select_warps or (4 if self.cand_pad <= 256 else 8 if self.cand_pad <= 1024 else 16)
        self.rank_warps = rank_warps
        d, b = depth_count, budget
        self.cand_i, self.cand_j = cand_i.to(device), cand_j.to(device)
        # the chunks' heads; with "filter", each depth's list (at most KP keys a chunk)
        self.heads = torch.empty(rows * d, self.chunks, self.kp, dtype=torch.int64, device=device)
        # `_radix_best`'s gathered keys, one [kp] slot per rank program: chunks', then merges'
        self.gathered = torch.empty(rows * d * (self.chunks + 1), self.kp, dtype=torch.int64, device=device)
        # "filter": each depth's group maxima, and its list's length (zeroed by the first launch)
        self.group_max = torch.empty(rows * d, self.groups, dtype=torch.int64, device=device)
        self.listed = torch.zeros(rows * d, dtype=torch.int32, device=device)
        self.ranked_logp = torch.empty(rows * d, self.k, dtype=torch.float32, device=device)
        self.ranked_tok = torch.empty(rows * d, self.k, dtype=torch.int64, device=device)
        self.level_parent = torch.empty(rows, d, b, dtype=torch.int32, device=device)
        self.level_rank = torch.empty(rows, d, b, dtype=torch.int32, device=device)
        self.node_of = torch.empty(rows, d, b, dtype=torch.int32, device=device)

    def build(self, logp: torch.Tensor, root: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
              depths: torch.Tensor, valid: torch.Tensor, visible: torch.Tensor) -> None:
        """logp [D, V] float32, root [] long -> writes tokens/parents/depths [N] long, valid [N] bool,
        visible [N, N] bool (N = B + 1) exactly as `build_tree` would return them. R trees at once
        (R <= rows): logp [R, D, V], root [R], and the outputs [R, N] and [R, N, N] (contiguous)."""
        for _, launch in self.launches(logp, root, tokens, parents, depths, valid, visible):
            launch()

    def launches(self, logp, root, tokens, parents, depths, valid, visible) -> list[tuple[str, object]]:
        """The build's kernel launches in order, as (name, zero-argument function): `build` runs
        them; benchmarks/tree_build.py times each one alone. Only the whole sequence builds a tree:
        the filter's launch appends to its depth's list, which the group launch before it empties."""
        d, v, b = self.depth_count, self.vocab, self.budget
        trees = logp.shape[0] if logp.dim() == 3 else 1
        if trees > self.rows:
            raise ValueError(f"{trees} trees at once, but this plan's scratch holds {self.rows}")
        logp = logp.contiguous()
        n = b + 1
        block_rows = 8

        def rank_chunks():  # rows x depths as one axis: each (row, depth) is ranked alone
            _rank_chunks[(trees * d, self.chunks)](logp, self.heads, self.gathered, v, CHUNK=self.chunk, KP=self.kp,
                                                   CHUNKS=self.chunks, IB=_bits(v), TOPK=self.topk,
                                                   RADIX=self.radix["chunks"], num_warps=self.rank_warps)

        def rank_merge():
            _rank_merge[(trees * d,)](self.heads, logp, self.ranked_logp, self.ranked_tok,
                                      self.gathered[trees * d * self.chunks:], v, K=self.k, KP=self.kp,
                                      MERGE=self.merge, HEADS=self.chunks * self.kp, IB=_bits(v), TOPK=self.topk,
                                      RADIX=self.radix["merge"], num_warps=self.rank_warps)

        def rank_groups():
            _rank_groups[(trees * d, self.chunks)](logp, self.group_max, self.listed, v, CHUNK=self.chunk,
                                                   GROUP=self.group, IB=_bits(v), num_warps=self.rank_warps)

        def rank_filter():
            _rank_filter[(trees * d, self.chunks)](logp, self.group_max, self.heads, self.listed, v, CHUNK=self.chunk,
                                                   KP=self.kp, GROUPS=self.groups, GP=_pow2(self.groups),
                                                   HEADS=self.chunks * self.kp, IB=_bits(v), TOPK=self.topk,
                                                   num_warps=self.rank_warps)

        def rank_list():
            _rank_list[(trees * d,)](self.heads, self.listed, logp, self.ranked_logp, self.ranked_tok, v, K=self.k,
                                     KP=self.kp, SHORT=self.short, HEADS=self.chunks * self.kp, IB=_bits(v),
                                     TOPK=self.topk, num_warps=self.rank_warps)

        def select():
            _select[(1, trees)](self.ranked_logp, self.ranked_tok, root, self.cand_i, self.cand_j,
                                self.level_parent, self.level_rank, self.node_of,
                                tokens, parents, depths, valid.view(torch.uint8),
                                D=d, K=self.k, B=b, BP=self.budget_pad, C=self.cand_count, CP=self.cand_pad,
                                IB1=_bits(b * self.k), IB2=_bits(d * b), TOPK=self.topk,
                                num_warps=self.select_warps)

        def write_visible():
            _visible[(triton.cdiv(n, block_rows), trees)](parents, visible.view(torch.uint8), n, NP=_pow2(n),
                                                          RB=block_rows, D=d, num_warps=4)

        ranks = ([("rank_groups", rank_groups), ("rank_filter", rank_filter), ("rank_list", rank_list)] if self.filter
                 else [("rank_chunks", rank_chunks), ("rank_merge", rank_merge)])
        return ranks + [("select", select), ("visible", write_visible)]


def _bits(count: int) -> int:
    return max(1, (count - 1).bit_length())


if triton is not None:

    @triton.jit
    def _key(v, pos, IB: tl.constexpr):
        """Unique int64 key: larger value first, then smaller position (`ddtree.tree.order_keys`)."""
        v = tl.where(v == 0.0, 0.0, v)  # -0.0 sorts as +0.0
        bits = v.to(tl.int32, bitcast=True)
        mono = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64) + 2147483648
        return (mono << IB) | ((1 << IB) - 1 - pos.to(tl.int64))

    @triton.jit
    def _best(key, N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr):
        """The K largest of key [N], largest first (K, N powers of two, 2 <= K <= N): a bitonic
        top-k (`tl.topk`), or a full bitonic sort and its first K (the first row of [N / K, K])."""
        if TOPK:
            best = tl.topk(key, K)
        elif N == K:
            best = tl.sort(key, descending=True)
        else:
            rows = tl.reshape(tl.sort(key, descending=True), [N // K, K])
            best = tl.max(tl.where(tl.arange(0, N // K)[:, None] == 0, rows, -1), axis=0)
        return best

    @triton.jit
    def _radix_best(key, slot_ptr, N: tl.constexpr, KP: tl.constexpr, IB: tl.constexpr):
        """The KP largest of key [N] (unique `_key`s, -1 for none), largest first, -1 past the live
        ones, where keys of one value lie in position order along the block (a chunk's keys; the
        chunks' heads, each best first, chunk after chunk).

        A radix select finds the KP-th largest value (the keys' high 32 bits, 8 a pass, each pass
        a histogram of the block's registers over the values that match the bits found so far);
        the keys above it and, of those at it, the first in block order (the smallest positions,
        as the keys order their ties) are gathered through slot_ptr [KP] (global scratch, in the
        order their cumulative counts give) and sorted. Cost: four histograms and a sort of KP,
        where a bitonic top-k of N takes ~log2(KP)^2 / 2 compare-exchange passes over the block."""
        live = key >= 0
        value = key >> IB
        bins = tl.arange(0, 256)
        take = tl.minimum(tl.sum(live.to(tl.int32), 0), KP)
        need = take  # of the keys matching `prefix`, how many the best KP still hold
        prefix = tl.full([], 0, tl.int64)  # the KP-th largest value's high bits, 8 more a pass
        for p in tl.static_range(4):
            shift = 24 - 8 * p
            match = live & ((value >> (shift + 8)) == prefix)
            hist = tl.histogram(((value >> shift) & 255).to(tl.int32), 256, mask=match)
            above = tl.sum(hist, 0) - tl.cumsum(hist, 0)  # matching keys whose digit is past each bin
            digit = tl.max(tl.where((above < need) & (above + hist >= need), bins, 0), 0)
            need -= tl.sum(tl.where(bins == digit, above, 0), 0)
            prefix = (prefix << 8) | digit.to(tl.int64)
        # Now `take - need` keys have a larger value than `prefix` and at least `need` have it.
        over = live & (value > prefix)
        at = tl.cumsum(over.to(tl.int32), 0) - 1
        tl.store(slot_ptr + at, key, mask=over & (at < take))
        tie = live & (value == prefix)
        at = take - need + tl.cumsum(tie.to(tl.int32), 0) - 1
        tl.store(slot_ptr + at, key, mask=tie & (at < take))
        tl.debug_barrier()  # the program's stores above, before its loads below
        o = tl.arange(0, KP)
        return tl.sort(tl.load(slot_ptr + o, mask=o < take, other=-1), descending=True)

    @triton.jit
    def _position(key, IB: tl.constexpr):
        return (1 << IB) - 1 - (key & ((1 << IB) - 1))

    @triton.jit
    def _value(key, IB: tl.constexpr):
        """The float32 a key was made from (`_key` inverted; -0.0 comes back as +0.0)."""
        t = (key >> IB) - 2147483648
        return tl.where(t >= 0, t, t ^ 0x7FFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)

    @triton.jit
    def _write_ranking(best, d, logp_ptr, ranked_logp_ptr, ranked_tok_ptr, V, K: tl.constexpr, KP: tl.constexpr,
                       IB: tl.constexpr):
        """Depth d's best keys [KP] (best first) -> its first K log-probs and token ids."""
        o = tl.arange(0, KP)
        first = o < K
        tok = _position(best, IB)
        value = tl.load(logp_ptr + d * V + tok, mask=first, other=0.0)
        tl.store(ranked_logp_ptr + d * K + o, value, mask=first)
        tl.store(ranked_tok_ptr + d * K + o, tok, mask=first)

    @triton.jit
    def _rank_chunks(logp_ptr, heads_ptr, gathered_ptr, V, CHUNK: tl.constexpr, KP: tl.constexpr,
                     CHUNKS: tl.constexpr, IB: tl.constexpr, TOPK: tl.constexpr, RADIX: tl.constexpr):
        """Program (depth, chunk): the chunk's best KP keys, best first, into heads[depth, chunk]."""
        d = tl.program_id(0)
        c = tl.program_id(1)
        offs = tl.arange(0, CHUNK)
        tok = c * CHUNK + offs
        inside = tok < V
        v = tl.load(logp_ptr + d * V + tok, mask=inside, other=0.0)
        key = tl.where(inside, _key(v, tok, IB), -1)
        if RADIX:
            best = _radix_best(key, gathered_ptr + (d * CHUNKS + c) * KP, CHUNK, KP, IB)
        else:
            best = _best(key, CHUNK, KP, TOPK)  # [KP]
        tl.store(heads_ptr + (d * CHUNKS + c) * KP + tl.arange(0, KP), best)

    @triton.jit
    def _rank_merge(heads_ptr, logp_ptr, ranked_logp_ptr, ranked_tok_ptr, gathered_ptr, V, K: tl.constexpr,
                    KP: tl.constexpr, MERGE: tl.constexpr, HEADS: tl.constexpr, IB: tl.constexpr,
                    TOPK: tl.constexpr, RADIX: tl.constexpr):
        """Program depth: the best K of all chunks' heads -> ranked log-probs and token ids [K]."""
        d = tl.program_id(0)
        offs = tl.arange(0, MERGE)
        heads = tl.load(heads_ptr + d * HEADS + offs, mask=offs < HEADS, other=-1)
        if RADIX:
            best = _radix_best(heads, gathered_ptr + d * KP, MERGE, KP, IB)
        else:
            best = _best(heads, MERGE, KP, TOPK)
        _write_ranking(best, d, logp_ptr, ranked_logp_ptr, ranked_tok_ptr, V, K, KP, IB)

    @triton.jit
    def _rank_groups(logp_ptr, group_max_ptr, listed_ptr, V, CHUNK: tl.constexpr, GROUP: tl.constexpr,
                     IB: tl.constexpr):
        """Program (depth, chunk): the largest key of each of the chunk's GROUP-token groups (-1 for
        one past the vocabulary) into group_max[depth]; chunk 0 also empties the depth's list."""
        d = tl.program_id(0)
        c = tl.program_id(1)
        tok = c * CHUNK + tl.arange(0, CHUNK)
        inside = tok < V
        v = tl.load(logp_ptr + d * V + tok, mask=inside, other=0.0)
        key = tl.where(inside, _key(v, tok, IB), -1)
        most = tl.max(tl.reshape(key, [CHUNK // GROUP, GROUP]), axis=1)
        tl.store(group_max_ptr + (d * tl.num_programs(1) + c) * (CHUNK // GROUP) + tl.arange(0, CHUNK // GROUP), most)
        if c == 0:
            tl.store(listed_ptr + d, 0)

    @triton.jit
    def _rank_filter(logp_ptr, group_max_ptr, list_ptr, listed_ptr, V, CHUNK: tl.constexpr, KP: tl.constexpr,
                     GROUPS: tl.constexpr, GP: tl.constexpr, HEADS: tl.constexpr, IB: tl.constexpr,
                     TOPK: tl.constexpr):
        """Program (depth, chunk): the chunk's keys at or above the KP-th largest group maximum of
        the depth, appended to its list (list [depth, HEADS], length listed[depth]) in any order; where
        more than KP pass, the chunk's best KP instead. KP distinct keys reach that threshold, so
        every key among the depth's best K <= KP passes it, and a chunk holds at most K of them."""
        d = tl.program_id(0)
        c = tl.program_id(1)
        g = tl.arange(0, GP)
        most = tl.load(group_max_ptr + d * GROUPS + g, mask=g < GROUPS, other=-1)
        floor = tl.min(_best(most, GP, KP, TOPK))  # -1 where fewer than KP groups hold a key
        tok = c * CHUNK + tl.arange(0, CHUNK)
        inside = tok < V
        v = tl.load(logp_ptr + d * V + tok, mask=inside, other=0.0)
        key = tl.where(inside, _key(v, tok, IB), -1)
        keep = inside & (key >= floor)
        count = tl.sum(keep.to(tl.int32), 0)
        if count <= KP:
            at = tl.atomic_add(listed_ptr + d, count) + tl.cumsum(keep.to(tl.int32), 0) - 1
            tl.store(list_ptr + d * HEADS + at, key, mask=keep & (at < HEADS))
        else:
            slots = tl.atomic_add(listed_ptr + d, KP) + tl.arange(0, KP)
            tl.store(list_ptr + d * HEADS + slots, _best(key, CHUNK, KP, TOPK), mask=slots < HEADS)

    @triton.jit
    def _rank_list(list_ptr, listed_ptr, logp_ptr, ranked_logp_ptr, ranked_tok_ptr, V, K: tl.constexpr,
                   KP: tl.constexpr, SHORT: tl.constexpr, HEADS: tl.constexpr, IB: tl.constexpr,
                   TOPK: tl.constexpr):
        """Program depth: the best K of the depth's list -> ranked log-probs and token ids [K]. The
        list is read SHORT keys at a time (one block but where many keys passed the threshold), each
        block's best KP merged into the running best: no block of the list's whole capacity, whose
        top-k would take as long to compile as the rest of the build."""
        d = tl.program_id(0)
        length = tl.minimum(tl.load(listed_ptr + d), HEADS)
        best = tl.full([KP], -1, tl.int64)
        start = 0
        while start < length:
            o = start + tl.arange(0, SHORT)
            block = _best(tl.load(list_ptr + d * HEADS + o, mask=o < length, other=-1), SHORT, KP, TOPK)
            best = _best(tl.reshape(tl.join(best, block), [2 * KP]), 2 * KP, KP, TOPK)
            start += SHORT
        _write_ranking(best, d, logp_ptr, ranked_logp_ptr, ranked_tok_ptr, V, K, KP, IB)

    @triton.jit
    def _select(rlogp_ptr, rtok_ptr, root_ptr, cand_i_ptr, cand_j_ptr, lparent_ptr, lrank_ptr, node_of_ptr,
                tokens_ptr, parents_ptr, depths_ptr, valid_ptr,
                D: tl.constexpr, K: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, C: tl.constexpr,
                CP: tl.constexpr, IB1: tl.constexpr, IB2: tl.constexpr, TOPK: tl.constexpr):
        """One program per tree (axis 1; axis 0 is one program): levels, global top-B, node
        numbering. Level entry (d, r) (the level's r-th best) has global position d * B + r; its
        parent rank and token rank go to lparent / lrank [D, B], read back once at the end after a
        block-wide barrier (`debug_barrier`)."""
        tree = tl.program_id(1)
        rlogp_ptr += tree * D * K
        rtok_ptr += tree * D * K
        root_ptr += tree
        lparent_ptr += tree * D * B
        lrank_ptr += tree * D * B
        node_of_ptr += tree * D * B
        tokens_ptr += tree * (B + 1)
        parents_ptr += tree * (B + 1)
        depths_ptr += tree * (B + 1)
        valid_ptr += tree * (B + 1)
        neg_inf = float("-inf")
        r = tl.arange(0, BP)
        top = r < B
        score = tl.load(rlogp_ptr + r, mask=r < K, other=neg_inf)  # level 0: the first depth's ranking
        tl.store(lparent_ptr + r, tl.zeros([BP], tl.int32), mask=top)
        tl.store(lrank_ptr + r, r, mask=top)
        best = tl.where(top, _key(score, r, IB2), -1)  # the running global top-B, best first
        floor = tl.min(tl.where(top, best, 9223372036854775807))  # its B-th best key

        c = tl.arange(0, CP)
        live = c < C
        ci = tl.load(cand_i_ptr + c, mask=live, other=0)
        cj = tl.load(cand_j_ptr + c, mask=live, other=0)
        d = tl.program_id(0) + 1
        # Each level's ranked log-probs (per candidate, and its best) are loaded one level ahead,
        # so that the load's latency overlaps the level before instead of starting each level.
        ahead = d < D
        vals = tl.load(rlogp_ptr + d * K + cj, mask=live & ahead, other=neg_inf)
        go = ahead & (_key(tl.max(score) + tl.load(rlogp_ptr + d * K, mask=ahead, other=neg_inf), d * B, IB2) > floor)
        while go:
            v = tl.gather(score, ci, 0) + vals
            ahead = d + 1 < D
            vals = tl.load(rlogp_ptr + (d + 1) * K + cj, mask=live & ahead, other=neg_inf)  # the next level's
            first = tl.load(rlogp_ptr + (d + 1) * K, mask=ahead, other=neg_inf)
            level = _best(tl.where(live, _key(v, ci * K + cj, IB1), -1), CP, BP, TOPK)  # [BP]
            pos = _position(level, IB1)
            tl.store(lparent_ptr + d * B + r, (pos // K).to(tl.int32), mask=top)
            tl.store(lrank_ptr + d * B + r, (pos % K).to(tl.int32), mask=top)
            score = tl.where(top, _value(level, IB1), neg_inf)
            merged = tl.reshape(tl.join(best, tl.where(top, _key(score, d * B + r, IB2), -1)), [2 * BP])
            best = tl.where(top, _best(merged, 2 * BP, BP, TOPK), -1)
            floor = tl.min(tl.where(top, best, 9223372036854775807))
            d += 1
            go = ahead & (_key(tl.max(score) + first, d * B, IB2) > floor)

        pos = _position(best, IB2)
        tl.store(node_of_ptr + pos, (r + 1).to(tl.int32), mask=top)
        tl.debug_barrier()
        depth = pos // B
        ok = top & (_value(best, IB2) > neg_inf)
        up = ok & (depth > 0)
        parent_rank = tl.load(lparent_ptr + pos, mask=up, other=0)
        parent = tl.load(node_of_ptr + (depth - 1) * B + parent_rank, mask=up, other=0).to(tl.int64)
        parent = tl.where(ok, parent, -1)
        token = tl.load(rtok_ptr + depth * K + tl.load(lrank_ptr + pos, mask=ok, other=0), mask=ok, other=0)
        tl.store(tokens_ptr + 1 + r, token, mask=top)
        tl.store(parents_ptr + 1 + r, parent, mask=top)
        tl.store(depths_ptr + 1 + r, tl.where(ok, depth + 1, 0), mask=top)
        tl.store(valid_ptr + 1 + r, ok.to(tl.uint8), mask=top)
        zero = r == 0
        tl.store(tokens_ptr + r, tl.load(root_ptr + r * 0, mask=zero, other=0), mask=zero)
        tl.store(parents_ptr + r, tl.full([BP], -1, tl.int64), mask=zero)
        tl.store(depths_ptr + r, tl.zeros([BP], tl.int64), mask=zero)
        tl.store(valid_ptr + r, tl.full([BP], 1, tl.uint8), mask=zero)

    @triton.jit
    def _visible(parents_ptr, visible_ptr, N, NP: tl.constexpr, RB: tl.constexpr, D: tl.constexpr):
        """Program (row block, tree): visible[i, j] = j is i or an ancestor of i (at most D steps up)."""
        parents_ptr += tl.program_id(1) * N
        visible_ptr += tl.program_id(1) * N * N
        rows = tl.program_id(0) * RB + tl.arange(0, RB)
        cols = tl.arange(0, NP)
        inside = rows < N
        seen = cols[None, :] == rows[:, None]
        cur = tl.load(parents_ptr + rows, mask=inside, other=-1)
        for _ in range(D):
            seen = seen | (cols[None, :] == cur[:, None])
            up = cur >= 0
            cur = tl.load(parents_ptr + tl.where(up, cur, 0), mask=up, other=-1)
        out = visible_ptr + rows[:, None] * N + cols[None, :]
        tl.store(out, seen.to(tl.uint8), mask=inside[:, None] & (cols[None, :] < N))
