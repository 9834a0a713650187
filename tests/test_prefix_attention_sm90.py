"""The Gluon prefix kernel (`ddtree/kernels/prefix_attention_sm90.py`) against float64, on an sm_90
GPU only (Gluon has no interpreter): each split's normalised output and log-sum-exp at every tiling
it picks from, splits past the prefix, a CUDA graph replayed after the prefix length changes on the
device, and `masked_attention`'s path through it."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")
if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the Gluon prefix kernel is for sm_90 (H100 / H200)", allow_module_level=True)

from ddtree.kernels.prefix_attention_sm90 import prefix_attention, reference  # noqa: E402


HEADS = [(32, 8, 128), (24, 4, 256), (8, 2, 64)]


def inputs(n, heads, keys, dtype=torch.bfloat16, seed=0):
    hq, hkv, d = heads
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(n, hq, d, device="cuda", dtype=dtype, generator=gen)
    cache = torch.randn(2, keys, hkv, d, device="cuda", dtype=dtype, generator=gen)
    return q, cache[0], cache[1]


def check(got, want, prefix_rows=None):
    o, lse = got
    ro, rlse = want
    assert torch.equal(torch.isinf(lse), torch.isinf(rlse))
    finite = ~torch.isinf(rlse)
    torch.testing.assert_close(lse[finite].double(), rlse[finite], atol=2e-2, rtol=0)
    torch.testing.assert_close(o.double()[finite], ro[finite], atol=2e-2, rtol=0)
    assert (o[~finite] == 0).all()


@pytest.mark.parametrize("heads", HEADS, ids=["qwen3-8b", "qwen3.6-27b", "d64"])
@pytest.mark.parametrize("n", [1, 17, 65, 257])
@pytest.mark.parametrize("prefix,splits", [(100, 1), (4133, 4), (32768, 16), (1000, 8), (9000, 7)])
def test_prefix_attention_equals_float64(heads, n, prefix, splits):
    keys = prefix + 300
    q, k, v = inputs(n, heads, keys)
    scale = heads[2] ** -0.5
    got = prefix_attention(q, k, v, torch.tensor(prefix, dtype=torch.int32, device="cuda"), keys, splits, scale)
    check(got, reference(q, k, v, prefix, keys, splits, scale))


TILINGS = {"two consumers, 64-key tiles": {"CONSUMERS": 2, "BLOCK_N": 64, "STAGES": 2, "PER_SM": 1},
           "two consumers, 128-key tiles": {"CONSUMERS": 2, "BLOCK_N": 128, "STAGES": 2, "PER_SM": 1},
           "two consumers, the idle one computing": {"CONSUMERS": 2, "BLOCK_N": 64, "STAGES": 2, "PER_SM": 1,
                                                     "SKIP_IDLE": False},
           "two consumers, no tail warp group": {"CONSUMERS": 2, "BLOCK_N": 128, "STAGES": 2, "PER_SM": 1,
                                                 "TAIL": False},
           "one consumer": {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "PER_SM": 1},
           "one consumer, two programs an SM": {"CONSUMERS": 1, "BLOCK_N": 64, "STAGES": 3, "PER_SM": 2}}


@pytest.mark.parametrize("config", TILINGS)
@pytest.mark.parametrize("heads", HEADS[:2], ids=["qwen3-8b", "qwen3.6-27b"])
@pytest.mark.parametrize("n", [16, 17, 36, 65])
def test_every_tiling_equals_float64(config, heads, n):
    """Every tiling `prefix_attention_sm90.tiling` picks from, whatever the row count (at two
    consumers, 16 and 65 tokens leave the last row block's second warp group with no real row; at
    head_dim 128, 36 and 65 tokens' rows past the last whole 128-row block, 16 and 4, go to the
    tail warp group unless "TAIL" is off)."""
    config = TILINGS[config]
    if heads[2] > 128 and (config["BLOCK_N"] > 64 or config["PER_SM"] > 1):
        pytest.skip("does not fit in one SM's shared memory or registers at head_dim 256")
    prefix, keys, splits = 5000, 5300, 4
    q, k, v = inputs(n, heads, keys)
    scale = heads[2] ** -0.5
    got = prefix_attention(q, k, v, torch.tensor(prefix, dtype=torch.int32, device="cuda"), keys, splits, scale,
                           config)
    check(got, reference(q, k, v, prefix, keys, splits, scale))


def test_merged_splits_equal_whole_softmax():
    """Splits merged by their log-sum-exp give the attention over every prefix key."""
    q, k, v = inputs(65, HEADS[0], 9000)
    scale = 128 ** -0.5
    o, lse = prefix_attention(q, k, v, torch.tensor(8192, dtype=torch.int32, device="cuda"), 9000, 8, scale)
    weights = torch.softmax(lse.double(), dim=0)[..., None]
    merged = (o.double() * weights).sum(0)
    whole, _ = reference(q, k, v, 8192, 9000, 1, scale)
    torch.testing.assert_close(merged, whole[0], atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_graph_replay_follows_the_prefix_length(dtype):
    """The prefix length read on the device at each replay, as int32 or as the engine keeps it (int64)."""
    heads = HEADS[0]
    q, k, v = inputs(65, heads, 20000)
    scale = 128 ** -0.5
    prefix = torch.tensor(16000, dtype=dtype, device="cuda")
    prefix_attention(q, k, v, prefix, 20000, 8, scale)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prefix_attention(q, k, v, prefix, 20000, 8, scale)
    for length in (16000, 19999, 3):
        prefix.fill_(length)
        graph.replay()
        check(out, reference(q, k, v, length, 20000, 8, scale))


@pytest.mark.parametrize("pdl", [True, False], ids=["dependent-launches", "after-each-other"])
def test_the_block_written_just_before_is_the_one_read(pdl, monkeypatch):
    """The engine's order: the layer's KV write (which lets the next launch start early), the kernel
    over the prefix and the tree's block, then the combine launch, the last two as programmatic
    dependent launches (`PDL`, or not): eagerly and replayed as a graph after new keys, values and
    queries are in place, the block's keys and values are those just written and the queries the
    new ones, for the kernel's partials and for `masked_attention`'s whole path."""
    from ddtree.kernels import attention_libraries, prefix_attention_sm90, tree_attention
    from ddtree.kernels.kv_write import write_kv

    monkeypatch.setattr(prefix_attention_sm90, "PDL", pdl)
    monkeypatch.setattr(attention_libraries, "GLUON_PREFIX", True)
    _, hkv, d = HEADS[0]
    n, context = 65, 32768
    q, k, v = inputs(n, HEADS[0], context + n + 300)
    new_k, new_v = torch.randn(2, n, hkv, d, device="cuda", dtype=q.dtype)
    slots = context + torch.arange(n, device="cuda")
    block = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    prefix = torch.tensor(context, device="cuda")
    scale = d ** -0.5

    def call():
        write_kv(k, v, slots, new_k, new_v)
        partials = prefix_attention(q, k, v, prefix, context + 300, 8, scale, block=block)
        write_kv(k, v, slots, new_k, new_v)
        return partials, tree_attention.masked_attention(q, k, v, block, scale, prefix_len=prefix,
                                                         min_prefix=context - 1000)

    partials, whole = call()
    check(partials, reference(q, k, v, context, context + 300, 8, scale, block=block))
    torch.testing.assert_close(whole.double(), masked_reference(q, k, v, block, context, scale), atol=2e-2, rtol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        partials, whole = call()
    for length in (context, context - 1000):
        prefix.fill_(length)
        slots.copy_(length + torch.arange(n, device="cuda"))
        new_k.normal_()
        new_v.normal_()
        q.normal_()
        graph.replay()
        check(partials, reference(q, k, v, length, context + 300, 8, scale, block=block))
        torch.testing.assert_close(whole.double(), masked_reference(q, k, v, block, length, scale), atol=2e-2, rtol=0)


def test_refuses_what_it_cannot_run():
    q, k, v = inputs(4, (8, 2, 64), 128, dtype=torch.float32)
    with pytest.raises(ValueError, match="bf16/fp16"):
        prefix_attention(q, k, v, torch.tensor(64, dtype=torch.int32, device="cuda"), 128, 1, 0.125)
    q, k, v = inputs(4, (8, 2, 64), 128)
    with pytest.raises(ValueError, match="bool mask"):
        prefix_attention(q, k, v, torch.tensor(64, dtype=torch.int32, device="cuda"), 64, 1, 0.125,
                         block=torch.ones(3, 4, dtype=torch.bool, device="cuda"))
    with pytest.raises(ValueError, match="int32 or int64"):
        prefix_attention(q, k, v, torch.tensor(64.0, device="cuda"), 64, 1, 0.125)


def masked_reference(q, k, v, block, prefix, scale):
    """The verify's attention (keys < prefix and the tree's block) in float64 -> [N, Hq * D]."""
    from ddtree.kernels.tree_attention import prefix_block_mask

    n, hq, d = q.shape
    group = hq // k.shape[1]
    seen = prefix_block_mask(torch.tensor(prefix, device="cuda"), block, k.shape[0])
    kk = k.double().repeat_interleave(group, 1)
    vv = v.double().repeat_interleave(group, 1)
    logits = torch.einsum("nhd,thd->hnt", q.double(), kk) * scale
    weights = torch.softmax(logits.masked_fill(~seen[None], float("-inf")), dim=-1)
    return torch.einsum("hnt,thd->nhd", weights, vv).reshape(n, hq * d)


@pytest.mark.parametrize("heads", HEADS, ids=["qwen3-8b", "qwen3.6-27b", "d64"])
@pytest.mark.parametrize("n", [17, 65, 257])
@pytest.mark.parametrize("prefix,splits", [(4133, 4), (32768, 11), (1000, 7)])
def test_the_block_in_the_first_split_equals_float64(heads, n, prefix, splits):
    """With the tree's mask the first split also attends to the block's keys [P, P + N), each row
    seeing those its token's mask allows; the other splits are as without it."""
    keys = prefix + 2 * n + 300
    q, k, v = inputs(n, heads, keys, seed=n)
    gen = torch.Generator(device="cuda").manual_seed(n + 1)
    block = (torch.rand(n, n, device="cuda", generator=gen) < 0.3) | torch.eye(n, dtype=torch.bool, device="cuda")
    scale = heads[2] ** -0.5
    max_keys = prefix + 300
    got = prefix_attention(q, k, v, torch.tensor(prefix, dtype=torch.int32, device="cuda"), max_keys, splits, scale,
                           block=block)
    check(got, reference(q, k, v, prefix, max_keys, splits, scale, block=block))


@pytest.mark.parametrize("heads,context,n", [((32, 8, 128), 32768, 65), ((32, 8, 128), 8192, 257),
                                             ((24, 4, 256), 8192, 65)], ids=["8b-32k-65", "8b-8k-257", "27b-8k-65"])
@pytest.mark.parametrize("fold", [True, False], ids=["block-in-gluon", "block-in-triton"])
def test_masked_attention_with_the_gluon_prefix(heads, context, n, fold, monkeypatch):
    """DDTREE_GLUON_PREFIX's path in `masked_attention`: the Gluon kernel over the prefix and the
    tree's block (or, GLUON_BLOCK off, the Triton kernel over the block), one combine: equal to
    float64, eagerly and as a graph replayed after the prefix length and the tree changed on the
    device."""
    from ddtree.kernels import attention_libraries, tree_attention

    monkeypatch.setattr(attention_libraries, "GLUON_PREFIX", True)
    monkeypatch.setattr(attention_libraries, "GLUON_BLOCK", fold)
    keys = context + n + 300
    q, k, v = inputs(n, heads, keys)
    gen = torch.Generator(device="cuda").manual_seed(n)
    block = (torch.rand(n, n, device="cuda", generator=gen) < 0.3) | torch.eye(n, dtype=torch.bool, device="cuda")
    scale = heads[2] ** -0.5
    prefix = torch.tensor(context, device="cuda")
    call = lambda: tree_attention.masked_attention(q, k, v, block, scale, prefix_len=prefix,  # noqa: E731
                                                   min_prefix=context - 200)
    torch.testing.assert_close(call().double(), masked_reference(q, k, v, block, context, scale), atol=2e-2, rtol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    prefix.fill_(context - 150)
    block.copy_(block.roll(1, dims=1) | torch.eye(n, dtype=torch.bool, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out.double(), masked_reference(q, k, v, block, context - 150, scale), atol=2e-2, rtol=0)


@pytest.mark.parametrize("heads,chunk,length", [((32, 8, 128), 1024, 9000), ((24, 4, 256), 512, 4700)],
                         ids=["qwen3-8b", "qwen3.6-27b"])
def test_a_prefill_chunk_attends_through_the_gluon_prefix(heads, chunk, length, monkeypatch):
    """The chunked prefill's last chunk (`engine.prefill_chunks`' meta: its prefix bounded by its
    start, a `chunk`) through `layers.attend`: the Gluon kernel over the prefix, cuDNN's causal
    attention over the chunk's own keys (no Triton attention launch), equal to float64; and the
    same chunk with the Triton kernel over its block."""
    from ddtree.engine import prefill_chunks
    from ddtree.kernels import attention_libraries, prefix_attention_sm90, tree_attention
    from ddtree.models.layers import attend

    monkeypatch.setattr(attention_libraries, "GLUON_PREFIX", True)
    calls = []
    kernel = prefix_attention_sm90.prefix_attention
    monkeypatch.setattr(prefix_attention_sm90, "prefix_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    rows, meta, _ = prefill_chunks(length, chunk, "cuda")[-1]
    start, c = rows.start, rows.stop - rows.start
    q, k, v = inputs(c, heads, meta.kv_len, seed=c)
    scale = heads[2] ** -0.5
    launches = []
    triton_launch = tree_attention._launch
    monkeypatch.setattr(tree_attention, "_launch", lambda *a, **kw: launches.append(1) or triton_launch(*a, **kw))
    block = torch.ones(c, c, dtype=torch.bool, device="cuda").tril()
    want = masked_reference(q, k, v, block, start, scale)
    torch.testing.assert_close(attend(q, k, v, meta, scale).double(), want, atol=2e-2, rtol=0)
    assert calls == [1] and launches == []
    meta.chunk = False  # a verify's form: the block through the mask, in the Gluon launch or the Triton kernel
    monkeypatch.setattr(attention_libraries, "GLUON_BLOCK_MAX_COLS", c)
    torch.testing.assert_close(attend(q, k, v, meta, scale).double(), want, atol=2e-2, rtol=0)
    assert calls == [1, 1] and launches == []
    monkeypatch.setattr(attention_libraries, "GLUON_BLOCK", False)
    torch.testing.assert_close(attend(q, k, v, meta, scale).double(), want, atol=2e-2, rtol=0)
    assert calls == [1, 1, 1] and launches == [1]


def test_a_batched_prefill_chunk_attends_alone(monkeypatch):
    """The batched engine's prefill chunk (one row of a packed forward, its meta from
    `prefill_chunks`) attends as the solo engine's: alone, through the Gluon prefix, equal to it."""
    from ddtree.engine import prefill_chunks
    from ddtree.kernels import attention_libraries, prefix_attention_sm90
    from ddtree.models.layers import AttentionMeta, RowSpan, attend

    monkeypatch.setattr(attention_libraries, "GLUON_PREFIX", True)
    calls = []
    kernel = prefix_attention_sm90.prefix_attention
    monkeypatch.setattr(prefix_attention_sm90, "prefix_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    heads, first_slot = (32, 8, 128), 512
    rows, alone, _ = prefill_chunks(4096 + 300, 4096, "cuda")[-1]
    c = rows.stop - rows.start
    q, k, v = inputs(c, heads, first_slot + alone.kv_len + 1000, seed=3)
    packed = AttentionMeta(alone.write_slots + first_slot, first_slot + alone.kv_len,
                           rows=[RowSpan(slice(0, c), first_slot, alone)])
    scale = heads[2] ** -0.5
    got = attend(q, k, v, packed, scale)
    assert calls == [1]
    window = slice(first_slot, first_slot + alone.kv_len)
    torch.testing.assert_close(got, attend(q, k[window], v[window], alone, scale), atol=0, rtol=0)
    block = torch.ones(c, c, dtype=torch.bool, device="cuda").tril()
    torch.testing.assert_close(got.double(), masked_reference(q, k[window], v[window], block, rows.start, scale),
                               atol=2e-2, rtol=0)


@pytest.mark.parametrize("heads", HEADS[:2], ids=["qwen3-8b", "qwen3.6-27b"])
@pytest.mark.parametrize("n", [65, 257])
def test_a_batchs_rows_in_one_launch_equal_float64(heads, n, monkeypatch):
    """`batched_masked_attention`'s prefix form through the Gluon kernel, the rows a batch of one
    launch: rows of different prefix lengths and first cache slots (one short, so that its later
    splits are empty), each token seeing its row's prefix and its tree's block, equal to float64 row
    by row; eagerly and replayed as a graph after the prefix lengths changed on the device (one row
    to no prefix at all)."""
    from ddtree.kernels import attention_libraries, prefix_attention_sm90, tree_attention

    monkeypatch.setattr(attention_libraries, "GLUON_PREFIX", True)
    calls = []
    kernel = prefix_attention_sm90.prefix_attention
    monkeypatch.setattr(prefix_attention_sm90, "prefix_attention",
                        lambda *a, **kw: calls.append(kw.get("first_slot") is not None) or kernel(*a, **kw))
    hq, hkv, d = heads
    batch, max_kv = 3, 12288
    gen = torch.Generator(device="cuda").manual_seed(n)
    q = torch.randn(batch * n, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    cache = torch.randn(2, batch * max_kv + 512, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = cache[0], cache[1]
    first = torch.tensor([0, max_kv, 2 * max_kv], device="cuda")
    prefix = torch.tensor([max_kv - n - 300, 5000, 700], device="cuda")
    eye = torch.eye(n, dtype=torch.bool, device="cuda")
    block = (torch.rand(batch, n, n, device="cuda", generator=gen) < 0.3) | eye
    scale = d ** -0.5

    def check_rows(out):
        for r in range(batch):
            lo, p = int(first[r]), int(prefix[r])
            want = masked_reference(q[r * n:(r + 1) * n], k[lo:lo + max_kv], v[lo:lo + max_kv], block[r], p, scale)
            torch.testing.assert_close(out[r * n:(r + 1) * n].double(), want, atol=2e-2, rtol=0)

    call = lambda: tree_attention.batched_masked_attention(q, k, v, block, scale, prefix, first, max_kv)  # noqa: E731
    check_rows(call())
    assert calls == [True]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    prefix.copy_(torch.tensor([max_kv - n - 1, 4096, 0], device="cuda"))
    graph.replay()
    check_rows(out)
