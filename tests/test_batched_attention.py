"""`kernels.tree_attention.batched_masked_attention` (many sequences' prefix-form attention in one
launch, each from its own cache row) equals `masked_attention` on each row alone and float64
attention: different prefix lengths per row (ending mid key block, zero, long enough that some
splits of the short rows see nothing), tree and all-True block masks, strided caches, forced and
automatic key splits, the combine folded or launched, padded rows. `layers.attend` reaches it for
a packed forward's prefix-form rows on CUDA and keeps the per-row loop on the CPU. On the CPU in
Triton's interpreter (small shapes); on a GPU also at Qwen3-8B's head layout in bf16, with a
CUDA-graph replay."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest has put Triton in interpreter mode
from test_tree_attention import reference, tree_mask  # noqa: E402

from ddtree.kernels import attention_combine, attention_libraries, attention_plan, tree_attention  # noqa: E402
from ddtree.kernels.attention_plan import AttentionConfig  # noqa: E402
from ddtree.kernels.tree_attention import batched_masked_attention, masked_attention, prefix_block_mask  # noqa: E402
from ddtree.models.layers import AttentionMeta, RowSpan, attend, attend_padded  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def batch_inputs(m, hq, hkv, d, prefixes, dtype, seed, strided=False, extra=16):
    """R = len(prefixes) rows of m tokens; row b's slots are [first[b], first[b] + row_slots), the
    rows laid out in reverse order in the cache (first slots need not grow with b). -> q [R * m,
    Hq, D], k, v [S, Hkv, D], first slots [R] and row_slots."""
    gen = torch.Generator().manual_seed(seed)
    r = len(prefixes)
    row_slots = max(prefixes) + m + extra
    slots = r * row_slots + 5
    q = torch.randn(r * m, hq, d, generator=gen)
    if strided:  # a slice of a [layers, slots, Hkv, D] cache, as the engine passes it
        cache = torch.randn(3, slots, hkv, d, generator=gen)
        k, v = cache[1], cache[2]
    else:
        k, v = torch.randn(slots, hkv, d, generator=gen), torch.randn(slots, hkv, d, generator=gen)
    first = torch.tensor([(r - 1 - b) * row_slots + 3 for b in range(r)])
    return *(t.to(DEVICE, dtype) for t in (q, k, v)), first.to(DEVICE), row_slots


def block_masks(m, r, kind, seed):
    if kind == "all":
        return torch.ones(r, m, m, dtype=torch.bool, device=DEVICE)
    return torch.stack([tree_mask(m, 0, m, seed=seed + b) for b in range(r)]).to(DEVICE)


def row_reference(q, k, v, block, prefix, first, b, m, scale, n=None):
    """float64 attention of row b's first n (default m) tokens alone, over its own slots, with the
    dense mask its form stands for."""
    n = m if n is None else n
    kv_len = prefix + n
    keys = slice(first, first + kv_len)
    dense = prefix_block_mask(torch.tensor(prefix, device=DEVICE), block[b, :n, :n], kv_len)
    return reference(q[b * m:b * m + n], k[keys], v[keys], dense, scale)


CASES = [  # m, Hq, Hkv, D, prefix lengths per row, strided cache
    (1, 4, 2, 16, [37], False),  # one row, one token (an autoregressive step)
    (5, 4, 2, 32, [20, 0], True),  # a row with no prefix
    (9, 4, 1, 16, [70, 0, 300], True),  # mid key block, none, long: splits of short rows see nothing
    (17, 2, 2, 16, [130, 5, 64], False),  # a prefix of exactly one key block
    (17, 4, 1, 16, [70, 0, 140], True),  # 68 rows a batch row: a 64-row block and a 4-row tail
]


@pytest.mark.parametrize("m,hq,hkv,d,prefixes,strided", CASES)
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("block", ["tree", "all"])
@pytest.mark.parametrize("balance", [True, False])
def test_batched_equals_rows_alone(m, hq, hkv, d, prefixes, strided, splits, block, balance):
    """Each row as if alone, with each batch row's keys split by its share of the batch's
    (`balance_rows`, where `splits` sets the work items) or every row alike over max_kv."""
    r = len(prefixes)
    q, k, v, first, row_slots = batch_inputs(m, hq, hkv, d, prefixes, torch.float32, seed=m + r, strided=strided)
    blk = block_masks(m, r, block, seed=m)
    prefix = torch.tensor(prefixes, device=DEVICE)
    config = AttentionConfig(balance_rows=balance)
    got = batched_masked_attention(q, k, v, blk, d**-0.5, prefix, first, max_kv=row_slots, splits=splits,
                                   config=config)
    assert got.shape == (r * m, hq * d) and got.dtype == q.dtype
    for b in range(r):
        kv_len = prefixes[b] + m
        keys = slice(int(first[b]), int(first[b]) + kv_len)
        alone = masked_attention(q[b * m:(b + 1) * m], k[keys], v[keys], blk[b], d**-0.5, splits=splits,
                                 prefix_len=prefix[b])
        mine = got[b * m:(b + 1) * m]
        if splits == 1:  # the same key blocks in the same order: the same arithmetic
            torch.testing.assert_close(mine, alone, atol=1e-6, rtol=1e-6)
        else:  # the split boundaries follow max_kv or the batch's keys here, the row's own length alone
            torch.testing.assert_close(mine, alone, atol=2e-5, rtol=1e-4)
        want = row_reference(q, k, v, blk, prefixes[b], int(first[b]), b, m, d**-0.5)
        torch.testing.assert_close(mine.double(), want.to(mine.device), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fold,tiled", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("splits", [2, 5])
@pytest.mark.parametrize("balance", [True, False])
def test_combine_in_kernel_or_launched(fold, tiled, splits, balance):
    """Each (row block, KV head, batch row) tile's splits are combined by its last split (arrival
    counters per tile, as many arrivals as the row has items where the split is balanced) or by
    the combine launch (split by split, or tiled; a balanced split's rows, 12 a batch row here, finding
    their items in 16-row blocks that cross batch rows); repeated calls find the counters zeroed."""
    m, prefixes = 6, [300, 12, 150]
    config = AttentionConfig(fold_combine=fold, combine_tiled=tiled, balance_rows=balance)
    blk = block_masks(m, 3, "tree", seed=4)
    prefix = torch.tensor(prefixes, device=DEVICE, dtype=torch.int32)
    for seed in range(2):
        q, k, v, first, row_slots = batch_inputs(m, 4, 2, 16, prefixes, torch.float32, seed=seed, strided=True)
        got = batched_masked_attention(q, k, v, blk, 0.25, prefix, first.to(torch.int32), max_kv=row_slots,
                                       config=config, splits=splits)
        for b in range(3):
            want = row_reference(q, k, v, blk, prefixes[b], int(first[b]), b, m, 0.25)
            torch.testing.assert_close(got[b * m:(b + 1) * m].double(), want.to(got.device), atol=2e-5, rtol=1e-4)


LONG_AMONG_SHORT = [  # prefixes of a batch, the balanced plan's (first item, items, tiles an item) per row
    # 8 slots (two programs an SM of 8, one row block, two KV heads), 4 rows: one wave, the long
    # row in four items of three key tiles (chunks of 2 would make 9 items)
    ([700, 5, 30, 0], [(0, 4, 3), (4, 1, 1), (5, 1, 1), (6, 1, 1)]),
    # 8 slots, 8 rows: in one wave the long row would run in one item of 32 tiles; in eight of four
    # among the short rows' seven, the programs that end take the next items
    ([2000] + [3] * 7, [(0, 8, 4)] + [(8 + i, 1, 1) for i in range(7)]),
]


@pytest.mark.parametrize("prefixes,plan", LONG_AMONG_SHORT)
@pytest.mark.parametrize("fold", [True, False])
def test_a_long_row_among_short_ones_gets_the_programs(prefixes, plan, fold, monkeypatch):
    """A balanced split (`plan_rows`, `row_items`) spreads a long row's keys over several programs
    and gives each short row one (the uniform split would give every row the same over max_kv);
    every row equals float64 attention, its partials merged by its last item (fold) or by the
    combine launch."""
    monkeypatch.setattr(tree_attention, "sm_count", lambda device: 8)  # the plans below: 8 SMs (a GPU has more)
    m, batch = 5, len(prefixes)
    config = AttentionConfig(fold_combine=fold, balance_rows=True)  # by default from BALANCE_MIN_KEYS keys on
    q, k, v, first, row_slots = batch_inputs(m, 4, 2, 16, prefixes, torch.float32, seed=21, strided=True)
    block_m, slots = attention_plan.plan_rows(m * 2, 2, batch, row_slots, tree_attention.sm_count(q.device), config)
    assert slots == 8
    assert attention_plan.row_items([p + m for p in prefixes], config.block_n, slots) == plan
    blk = block_masks(m, batch, "tree", seed=2)
    prefix = torch.tensor(prefixes, device=DEVICE)
    for _ in range(2):  # the arrival counters left at zero
        got = batched_masked_attention(q, k, v, blk, 0.25, prefix, first, max_kv=row_slots, config=config)
        for b in range(batch):
            want = row_reference(q, k, v, blk, prefixes[b], int(first[b]), b, m, 0.25)
            torch.testing.assert_close(got[b * m:(b + 1) * m].double(), want.to(got.device), atol=2e-5, rtol=1e-4)


def test_rows_past_the_folds_reach_go_to_the_combine_launch(monkeypatch):
    """With 64-row blocks the fold takes rows of up to 8 items (FOLD_MAX_PARTIALS // 64): in 20
    slots the long row's 12 items go to the combine launch, which skips the rows the
    attention launch wrote (one item each, written whole); all equal float64 attention."""
    launches = []
    original = attention_combine.launch_combine
    monkeypatch.setattr(attention_combine, "launch_combine", lambda *a: launches.append(a[-1]) or original(*a))
    m, prefixes = 5, [700, 5, 30]
    q, k, v, first, row_slots = batch_inputs(m, 4, 2, 16, prefixes, torch.float32, seed=22)
    assert [x[1] for x in attention_plan.row_items([p + m for p in prefixes], 64, 20)] == [12, 1, 1]
    blk = block_masks(m, 3, "tree", seed=5)
    got = batched_masked_attention(q, k, v, blk, 0.25, torch.tensor(prefixes, device=DEVICE), first,
                                   max_kv=row_slots, config=AttentionConfig(block_m=64, balance_rows=True), splits=20)
    assert len(launches) == 1 and launches[0][7] == 8  # rows_of: rows of up to 8 items folded
    for b in range(3):
        want = row_reference(q, k, v, blk, prefixes[b], int(first[b]), b, m, 0.25)
        torch.testing.assert_close(got[b * m:(b + 1) * m].double(), want.to(got.device), atol=2e-5, rtol=1e-4)


def test_by_default_the_split_follows_the_rows_from_a_long_bound_on():
    """balance_rows None (the default): rows split alike under BALANCE_MIN_KEYS keys of max_kv,
    by their own keys from it on where a batch row's rows are BALANCE_MAX_ROWS or fewer (the
    kernel's grid: R * splits programs a row block and KV head, or slots + R)."""
    grids = []
    original = tree_attention._attention

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid[2])
            return original[grid]

    m, prefixes = 3, [40, 9]
    q, k, v, first, _ = batch_inputs(m, 4, 2, 16, prefixes, torch.float32, seed=3)
    blk = block_masks(m, 2, "all", seed=0)
    prefix = torch.tensor(prefixes, device=DEVICE)
    tree_attention._attention = Spy()
    try:
        for max_kv in (attention_plan.BALANCE_MIN_KEYS - 1, attention_plan.BALANCE_MIN_KEYS):
            k_long = torch.cat([k, torch.zeros(max_kv, 2, 16, device=DEVICE)])  # room for the bound
            v_long = torch.cat([v, torch.zeros(max_kv, 2, 16, device=DEVICE)])
            got = batched_masked_attention(q, k_long, v_long, blk, 0.25, prefix, first, max_kv=max_kv, splits=3)
            for b in range(2):
                want = row_reference(q, k, v, blk, prefixes[b], int(first[b]), b, m, 0.25)
                torch.testing.assert_close(got[b * m:(b + 1) * m].double(), want.to(got.device), atol=2e-5, rtol=1e-4)
    finally:
        tree_attention._attention = original
    assert grids == [2 * 3, 3 + 2]


def test_row_items_cover_each_rows_keys_once():
    """The balanced plan on the host (`row_items`): each row's items cover its key tiles once, in
    items of equal span (the last no emptier than a span), one item at least (a row with no key
    still writes its zeros), the batch's items consecutive and within slots + rows, within the slots
    where the rows of equal keys fit in them, and no item longer than the larger of the two chunks
    it chooses between (`chunk_within`: the shortest that keeps the items within the slots, and
    within slots + rows)."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):
        batch = int(torch.randint(1, 9, (1,), generator=gen))
        keys = [int(x) for x in torch.randint(0, 3000, (batch,), generator=gen)]
        if trial % 3 == 0:
            keys[0] = 100_000  # one long row
        if trial % 5 == 0:
            keys = [keys[0]] * batch  # rows of equal keys
        slots = int(torch.randint(1, 40, (1,), generator=gen))
        items = attention_plan.row_items(keys, 64, slots)
        first = 0
        tiles = [max(1, -(-k // 64)) for k in keys]
        for t, (row_first, count, span) in zip(tiles, items):
            assert row_first == first and count >= 1 and (count - 1) * span < t <= count * span
            first += count
        assert first <= slots + batch
        if len(set(keys)) == 1 and batch <= slots:
            assert first <= slots
        bound = attention_plan.chunk_within(tiles, slots + batch)
        if batch <= slots:
            bound = max(bound, attention_plan.chunk_within(tiles, slots))
        assert max(span for _, _, span in items) <= bound


def test_row_items_on_the_device_match_the_host():
    """`_row_items` (each program's plan, on the device, its searches between narrower bounds)
    equals `row_items` (the host's mirror that the tests and benchmarks read), keys capped at
    max_kv (a padded row's unused block columns may pass it: the fourth case's second row), rows
    past the batch at zero."""
    import triton
    import triton.language as tl

    @triton.jit
    def plan_kernel(prefix_ptr, out_ptr, batch, block_cols, max_keys, slots, BLOCK_N: tl.constexpr,
                    BATCH_P: tl.constexpr):
        firsts, counts, spans = attention_plan.device_row_items(prefix_ptr, batch, block_cols, max_keys, slots,
                                                                BLOCK_N, BATCH_P)
        rb = tl.arange(0, BATCH_P)
        tl.store(out_ptr + rb * 3, firsts)
        tl.store(out_ptr + rb * 3 + 1, counts)
        tl.store(out_ptr + rb * 3 + 2, spans)

    for prefixes, cols, max_keys, slots in (([700, 5, 30, 0], 5, 721, 8), ([40000, 100, 3000, 17], 65, 40100, 66),
                                            ([0, 0, 0], 1, 9, 3), ([129, 4000, 64], 17, 3000, 7),
                                            ([5000] + [10] * 7, 1, 6000, 8), ([3000, 1, 2, 3, 4], 1, 4000, 3)):
        batch_p = triton.next_power_of_2(len(prefixes))
        out = torch.full((batch_p, 3), -1, dtype=torch.int32, device=DEVICE)
        plan_kernel[(1,)](torch.tensor(prefixes, device=DEVICE), out, len(prefixes), cols, max_keys, slots,
                          BLOCK_N=64, BATCH_P=batch_p)
        want = attention_plan.row_items([min(p + cols, max_keys) for p in prefixes], 64, slots)
        assert out[:len(prefixes)].tolist() == [list(x) for x in want]
        assert not out[len(prefixes):, 1:].any()


def window_mask(context: int, m: int, window: int, max_kv: int) -> torch.Tensor:
    """A drafter sliding layer's mask [m, max_kv] for a block of m tokens after `context` keys:
    token i (position context + i) sees keys (context + i - window, context + i]."""
    pos = context + torch.arange(m)[:, None]
    cols = torch.arange(max_kv)[None, :]
    return ((cols <= pos) & (cols > pos - window)).to(DEVICE)


@pytest.mark.parametrize("splits", [1, 3, None])
def test_mask_form_equals_rows_alone(splits):
    """The mask form (each row's own mask over its keys, as the drafter's sliding layers in a
    batched round): every row equals `masked_attention` on its own slots and float64 attention,
    rows far apart in the cache and in reverse order, windows cutting the context or not."""
    m, contexts, window = 5, [90, 3, 40], 24
    q, k, v, first, row_slots = batch_inputs(m, 4, 2, 16, contexts, torch.float32, seed=13, strided=True)
    masks = torch.stack([window_mask(c, m, window, row_slots) for c in contexts])  # [R, m, row_slots]
    ranges = torch.cat([tree_attention.key_range(mask) for mask in masks])
    got = batched_masked_attention(q, k, v, masks, 0.25, None, first, max_kv=row_slots, splits=splits, ranges=ranges)
    assert got.shape == (len(contexts) * m, 4 * 16)
    for b in range(len(contexts)):
        keys = slice(int(first[b]), int(first[b]) + row_slots)
        alone = masked_attention(q[b * m:(b + 1) * m], k[keys], v[keys], masks[b], 0.25, splits=splits)
        torch.testing.assert_close(got[b * m:(b + 1) * m], alone, atol=2e-5, rtol=1e-4)
        want = reference(q[b * m:(b + 1) * m], k[keys], v[keys], masks[b], 0.25)
        torch.testing.assert_close(got[b * m:(b + 1) * m].double(), want.to(got.device), atol=2e-5, rtol=1e-4)


def test_mask_form_checks_its_shapes():
    q, k, v, first, row_slots = batch_inputs(3, 4, 2, 16, [10, 20], torch.float32, seed=1)
    masks = torch.stack([window_mask(c, 3, 8, row_slots) for c in (10, 20)])
    with pytest.raises(ValueError, match="mask form"):
        batched_masked_attention(q, k, v, masks, 0.25, None, first, max_kv=row_slots)  # no ranges
    with pytest.raises(ValueError, match="mask form"):
        batched_masked_attention(q, k, v, masks[:, :, :-1], 0.25, None, first, max_kv=row_slots,
                                 ranges=torch.zeros(6, 2, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("splits", [1, 3])
def test_padding_is_finite_and_leaves_rows_alone(splits):
    """Row 1 has 3 real tokens of m = 7 and no prefix; its padding tokens see nothing (all-False
    block rows): zeros, not NaN. Its real tokens and the other rows are as if alone, and the block
    keys past row 1's tokens (read, never seen) may hold anything finite."""
    m, prefixes, real = 7, [90, 0, 40], [7, 3, 5]
    q, k, v, first, row_slots = batch_inputs(m, 4, 2, 16, prefixes, torch.float32, seed=9)
    blk = block_masks(m, 3, "tree", seed=1)
    for b, n in enumerate(real):
        blk[b, n:] = False
        blk[b, :, n:] = False
    prefix = torch.tensor(prefixes, device=DEVICE)
    got = batched_masked_attention(q, k, v, blk, 0.25, prefix, first, max_kv=row_slots, splits=splits)
    assert torch.isfinite(got).all()
    assert not got[m + 3:2 * m].any()
    for b, n in enumerate(real):
        want = row_reference(q, k, v, blk, prefixes[b], int(first[b]), b, m, 0.25, n)
        torch.testing.assert_close(got[b * m:b * m + n].double(), want.to(got.device), atol=2e-5, rtol=1e-4)


def test_shapes_do_not_follow_prefix_lengths():
    """The launch depends on max_kv, not on the prefix lengths: the same batch with its rows'
    prefixes changed plans the same grid and partials (what lets one graph serve the batch)."""
    seen = []
    original = tree_attention._launch

    def spy(*args):
        seen.append(args[7])  # max_kv: the split plan's bound
        return original(*args)

    m = 3
    q, k, v, first, row_slots = batch_inputs(m, 4, 2, 16, [200, 10], torch.float32, seed=2)
    blk = block_masks(m, 2, "all", seed=0)
    tree_attention._launch = spy
    try:
        for prefixes in ([200, 10], [3, 150]):
            prefix = torch.tensor(prefixes, device=DEVICE)
            got = batched_masked_attention(q, k, v, blk, 0.25, prefix, first, max_kv=row_slots)
            for b in range(2):
                want = row_reference(q, k, v, blk, prefixes[b], int(first[b]), b, m, 0.25)
                torch.testing.assert_close(got[b * m:(b + 1) * m].double(), want.to(got.device), atol=2e-5, rtol=1e-4)
    finally:
        tree_attention._launch = original
    assert seen == [row_slots, row_slots]


def packed_rows(sizes, prefixes, row_slots, seed, device=DEVICE):
    """A packed forward's rows as `BatchEngine` makes them: row b's `sizes[b]` tokens after row
    b - 1's, each with its prefix-form meta alone (a tree's visibility) and its first slot."""
    rows, start = [], 0
    for b, (n, p) in enumerate(zip(sizes, prefixes)):
        alone = AttentionMeta(torch.arange(n, device=device) + p, p + n + 2,
                              prefix_len=torch.tensor(p, device=device),
                              block_mask=tree_mask(n, 0, n, seed=seed + b).to(device))
        rows.append(RowSpan(slice(start, start + n), b * row_slots, alone))
        start += n
    return rows


def test_padded_layout_equals_the_per_row_loop():
    """`PaddedRows.from_rows` pads a packed forward's rows of different sizes into [R, M] places,
    and the batched kernel over them gives every packed token its per-row loop's output, in the
    packed order (on the CPU the loop is PyTorch's attention)."""
    hq, hkv, d, row_slots = 4, 2, 16, 160
    sizes, prefixes = [4, 1, 9], [50, 130, 0]
    rows = packed_rows(sizes, prefixes, row_slots, seed=5)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(sizes), hq, d, generator=gen).to(DEVICE)
    k, v = (torch.randn(3 * row_slots, hkv, d, generator=gen).to(DEVICE) for _ in range(2))
    meta = AttentionMeta(torch.zeros(sum(sizes), dtype=torch.long, device=DEVICE), 3 * row_slots, rows=rows)
    padded = meta.padded_rows()
    assert padded is meta.padded_rows()  # made once per forward, shared by the layers
    assert padded.block_mask.shape == (3, 9, 9) and padded.max_kv == 130 + 1 + 2
    assert padded.first_slot.tolist() == [0, row_slots, 2 * row_slots] and padded.prefix_len.tolist() == prefixes
    got = attend_padded(q, k, v, padded, 0.25)
    torch.testing.assert_close(got, attend(q, k, v, meta, 0.25), atol=2e-5, rtol=1e-4)


def test_rows_already_in_place_are_not_moved():
    """Rows of equal size one after another (the drafter's blocks) are the padded layout already:
    no gather or scatter."""
    rows = packed_rows([4, 4, 4], [9, 0, 70], 100, seed=3)
    meta = AttentionMeta(torch.zeros(12, dtype=torch.long, device=DEVICE), 300, rows=rows)
    padded = meta.padded_rows()
    assert padded.gather is None and padded.scatter is None and padded.block_mask.shape == (3, 4, 4)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(12, 2, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(300, 1, 16, generator=gen).to(DEVICE) for _ in range(2))
    torch.testing.assert_close(attend_padded(q, k, v, padded, 0.25), attend(q, k, v, meta, 0.25), atol=2e-5, rtol=1e-4)


def test_padded_layout_needs_the_prefix_form():
    rows = packed_rows([2, 3], [5, 7], 40, seed=0)
    rows[1].meta = AttentionMeta(rows[1].meta.write_slots, 12, torch.ones(3, 12, dtype=torch.bool, device=DEVICE))
    meta = AttentionMeta(torch.zeros(5, dtype=torch.long, device=DEVICE), 80, rows=rows)
    assert meta.padded_rows() is None


def test_cpu_attend_keeps_the_per_row_loop(monkeypatch):
    """Without CUDA a packed forward's rows go through the per-row loop (PyTorch's attention, so
    batched decoding equals single-sequence decoding exactly in float32), never the batched kernel."""
    def refuse(*args, **kwargs):
        raise AssertionError("the batched kernel ran on the CPU")

    monkeypatch.setattr(tree_attention, "batched_masked_attention", refuse)
    sizes, prefixes, row_slots = [3, 2], [20, 7], 40
    rows = packed_rows(sizes, prefixes, row_slots, seed=1, device="cpu")  # CPU tensors on any machine
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 16, generator=gen)
    k, v = torch.randn(2 * row_slots, 2, 16, generator=gen), torch.randn(2 * row_slots, 2, 16, generator=gen)
    meta = AttentionMeta(torch.zeros(5, dtype=torch.long), 2 * row_slots, rows=rows)
    got = attend(q, k, v, meta, 0.25)
    for row in rows:
        keys = slice(row.first_slot, row.first_slot + row.meta.kv_len)
        assert torch.equal(got[row.tokens], attend(q[row.tokens], k[keys], v[keys], row.meta, 0.25))


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_cuda_attend_uses_one_batched_launch(monkeypatch):
    """On CUDA a packed forward whose rows are all in the prefix form is one batched launch; a row
    in another form (a sliding layer's dense mask) sends the forward back to the per-row loop."""
    calls = {"batched": 0, "alone": 0}
    batched, alone = tree_attention.batched_masked_attention, tree_attention.masked_attention

    def count_batched(*args, **kwargs):
        calls["batched"] += 1
        return batched(*args, **kwargs)

    def count_alone(*args, **kwargs):
        calls["alone"] += 1
        return alone(*args, **kwargs)

    monkeypatch.setattr(tree_attention, "batched_masked_attention", count_batched)
    monkeypatch.setattr(tree_attention, "masked_attention", count_alone)
    sizes, prefixes, row_slots = [17, 1, 65, 5], [100, 3000, 17, 900], 3200
    rows = packed_rows(sizes, prefixes, row_slots, seed=2)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(sizes), 32, 128, generator=gen).to(DEVICE, torch.bfloat16)
    cache = torch.randn(2, 4 * row_slots, 8, 128, generator=gen).to(DEVICE, torch.bfloat16)
    meta = AttentionMeta(torch.zeros(sum(sizes), dtype=torch.long, device=DEVICE), 4 * row_slots, rows=rows)
    got = attend(q, cache[0], cache[1], meta, 128**-0.5)
    assert calls == {"batched": 1, "alone": 0}
    for row in rows:
        keys = slice(row.first_slot, row.first_slot + row.meta.kv_len)
        want = attend(q[row.tokens], cache[0, keys], cache[1, keys], row.meta, 128**-0.5)
        torch.testing.assert_close(got[row.tokens], want, atol=2e-2, rtol=2e-2)
    calls.update(batched=0, alone=0)
    dense = rows[1].meta.dense_mask()
    rows[1].meta = AttentionMeta(rows[1].meta.write_slots, rows[1].meta.kv_len, dense)
    attend(q, cache[0], cache[1], AttentionMeta(meta.write_slots, meta.kv_len, rows=rows), 128**-0.5)
    assert calls == {"batched": 0, "alone": 4}


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_qwen3_heads_bf16_and_graph():
    """Four trees of 65 nodes over prefixes of 100, 3000, 17 and 40000 keys at Qwen3-8B heads in
    bf16: each row equals float64 attention over its own slots, and a CUDA-graph replay (the
    prefixes changed in place, as a graph-captured batched round would) equals the eager call."""
    from ddtree.engine import capture_graph

    m, prefixes = 65, [100, 3000, 17, 40000]
    q, k, v, first, row_slots = batch_inputs(m, 32, 8, 128, prefixes, torch.bfloat16, seed=7, strided=True, extra=900)
    blk = block_masks(m, 4, "tree", seed=3)
    prefix = torch.tensor(prefixes, device=DEVICE)

    def check(got, lengths):
        for b, p in enumerate(lengths):
            want = row_reference(q, k, v, blk, p, int(first[b]), b, m, 128**-0.5)
            torch.testing.assert_close(got[b * m:(b + 1) * m].double(), want, atol=2e-2, rtol=2e-2)

    for _ in range(2):  # many programs race to the arrival counters: every repeat must combine right
        eager = batched_masked_attention(q, k, v, blk, 128**-0.5, prefix, first, max_kv=row_slots)
        check(eager, prefixes)
    graph, out = capture_graph(lambda: batched_masked_attention(q, k, v, blk, 128**-0.5, prefix, first,
                                                                max_kv=row_slots))
    graph.replay()
    assert torch.equal(out, eager)
    moved = [40500, 64, 2000, 1]
    prefix.copy_(torch.tensor(moved))
    graph.replay()
    check(out, moved)
    assert torch.equal(out, batched_masked_attention(q, k, v, blk, 128**-0.5, prefix, first, max_kv=row_slots))


def test_the_benchmark_prints_its_splits_without_a_gpu(monkeypatch, capsys):
    """`benchmarks/batched_attention.py --plan-only`: each case's key split both ways for an H200's
    132 SMs, as benchmarks/README.md gives them: the skewed batch's long row spread, equal rows alike."""
    import json
    import sys

    from benchmarks import batched_attention

    monkeypatch.setattr(sys, "argv", ["batched_attention", "--plan-only", "--rows", "16", "--tokens", "17",
                                      "--contexts", "skewed,32768"])
    batched_attention.main()
    skewed, equal = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert skewed["uniform"] == [4, 129] and skewed["balanced"] == [47, 11]
    assert equal["uniform"] == equal["balanced"] == [4, 129]


def test_a_gluon_kernel_that_fails_on_a_batch_leaves_the_triton_kernel(monkeypatch, caplog):
    """Where the Gluon kernel takes a batch (`_gluon_prefix` true for a row's tokens), its rows go to
    one launch with their first slots and block masks; if it fails to build or launch, the Triton
    kernel attends, equal to float64 row by row, with a warning, and later batches do not try it."""
    from ddtree.kernels import prefix_attention_sm90

    seen = []

    def failing(q, k, v, prefix_len, max_keys, splits, scale, config=None, block=None, first_slot=None):
        seen.append((tuple(q.shape), tuple(block.shape), tuple(first_slot.shape), tuple(prefix_len.shape), max_keys))
        raise RuntimeError("this Gluon does not build the kernel")

    monkeypatch.setattr(attention_libraries, "_GLUON_FAILED", set())
    monkeypatch.setattr(attention_libraries, "_gluon_prefix", lambda q, k, v, min_prefix, tokens=None:
                        (q.dtype, q.shape[-1]) not in attention_libraries._GLUON_FAILED)
    monkeypatch.setattr(prefix_attention_sm90, "prefix_attention", failing)
    m, hq, hkv, d, prefixes = 5, 4, 2, 16, [40, 0, 23]
    q, k, v, first, row_slots = batch_inputs(m, hq, hkv, d, prefixes, torch.float32, seed=11)
    block = block_masks(m, len(prefixes), "tree", seed=11)
    prefix = torch.tensor(prefixes, device=DEVICE)
    for _ in range(2):
        out = batched_masked_attention(q, k, v, block, d**-0.5, prefix, first, row_slots)
        for b, p in enumerate(prefixes):
            want = row_reference(q, k, v, block, p, int(first[b]), b, m, d**-0.5)
            torch.testing.assert_close(out[b * m:(b + 1) * m].double(), want.to(out.device), atol=2e-5, rtol=1e-4)
    assert seen == [((15, hq, d), (3, m, m), (3,), (3,), row_slots)]
    assert "the Gluon prefix kernel failed on a batch" in caplog.text
