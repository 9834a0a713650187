"""`kernels.tree_attention.masked_attention` equals PyTorch's attention with the same mask: tree,
causal-block and padding masks, GQA groups, with and without the key split (and splits that see
no key at all); the prefix form (prefix length + block mask) equals the dense mask it stands for. On the CPU in Triton's interpreter (small shapes); on a GPU also at Qwen3-8B's
head layout in bf16."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # without a GPU, conftest has put Triton in interpreter mode
from ddtree.kernels.attention_plan import (  # noqa: E402
    DEFAULT, LONG, LONG_256, MID_256, AttentionConfig, plan, tiling)
from ddtree.kernels.tree_attention import key_range, masked_attention, prefix_block_mask  # noqa: E402
from ddtree.tree import build_tree  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def reference(q, k, v, mask, scale):
    """float64 attention with the query heads grouped onto their KV heads -> [N, Hq * D]."""
    n, hq, d = q.shape
    group = hq // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, T, D]
    vv = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    logits = torch.einsum("nhd,htd->hnt", q.double(), kk) * scale
    logits = logits.masked_fill(~mask[None], float("-inf"))
    out = torch.einsum("hnt,htd->nhd", F.softmax(logits, dim=-1), vv)
    return out.reshape(n, hq * d)


def tree_mask(n: int, context: int, kv_len: int, seed: int) -> torch.Tensor:
    """[n, kv_len]: the whole context, then the ancestor-only visibility of a random tree of n
    nodes, then False padding columns."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(8, 50, generator=gen), dim=-1)
    tree = build_tree(logp, torch.tensor(1), n - 1)
    mask = torch.zeros(n, kv_len, dtype=torch.bool)
    mask[:, :context] = True
    mask[:, context:context + n] = tree.visible
    return mask


def inputs(n, hq, hkv, d, kv_len, dtype, seed, strided_cache=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=gen)
    if strided_cache:  # a slice of a [layers, slots, Hkv, D] cache, as the engine passes it
        cache = torch.randn(3, kv_len + 40, hkv, d, generator=gen)
        k, v = cache[1, :kv_len], cache[2, :kv_len]
    else:
        k, v = torch.randn(kv_len, hkv, d, generator=gen), torch.randn(kv_len, hkv, d, generator=gen)
    return [t.to(DEVICE, dtype) for t in (q, k, v)]


SMALL = [  # n, Hq, Hkv, D, context, kv_len (>= context + n: the rest is padding)
    (1, 4, 2, 16, 37, 38),
    (5, 4, 2, 32, 20, 64),
    (17, 4, 1, 16, 70, 100),
    (9, 2, 2, 16, 130, 140),
]


@pytest.mark.parametrize("n,hq,hkv,d,context,kv_len", SMALL)
@pytest.mark.parametrize("splits", [1, 3, None])
def test_equals_reference_small(n, hq, hkv, d, context, kv_len, splits):
    q, k, v = inputs(n, hq, hkv, d, kv_len, torch.float32, seed=n + kv_len, strided_cache=n % 2 == 1)
    mask = tree_mask(n, context, kv_len, seed=n).to(DEVICE)
    got = masked_attention(q, k, v, mask, d**-0.5, splits=splits)
    assert got.shape == (n, hq * d) and got.dtype == q.dtype
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, d**-0.5).to(got.device), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n,hq,hkv,d,context,kv_len", SMALL)
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("block", ["tree", "all"])
def test_prefix_form_equals_dense_mask(n, hq, hkv, d, context, kv_len, splits, block):
    """prefix_len + block mask (the engine's verify: a tree; the drafter's block: all True) gives
    exactly the output of the dense mask it stands for, and both equal the reference."""
    q, k, v = inputs(n, hq, hkv, d, kv_len, torch.float32, seed=n + kv_len + 1, strided_cache=n % 2 == 0)
    blk = tree_mask(n, 0, n, seed=n + 3) if block == "tree" else torch.ones(n, n, dtype=torch.bool)
    blk = blk.to(DEVICE)
    prefix = torch.tensor(context, device=DEVICE)
    dense = prefix_block_mask(prefix, blk, kv_len)
    assert dense[:, :context].all() and not dense[:, context + n:].any()
    assert torch.equal(dense[:, context:context + n], blk)
    got = masked_attention(q, k, v, blk, d**-0.5, splits=splits, prefix_len=prefix)
    # the prefix's unmasked loop may contract its arithmetic differently (FMA) when compiled
    torch.testing.assert_close(got, masked_attention(q, k, v, dense, d**-0.5, splits=splits), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got.double(), reference(q, k, v, dense, d**-0.5).to(got.device), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fold,block_d,tiled", [(True, 32, False), (False, 32, False), (False, 8, False),
                                                (False, 16, True), (False, 8, True), (False, 32, None)])
@pytest.mark.parametrize("splits", [2, 5, 9])
@pytest.mark.parametrize("loads", [256, 8192])  # 1 split per load group at 256 (16 rows x 16 dims)
def test_split_combine_in_kernel_or_launched(fold, block_d, tiled, splits, loads):
    """The split combine done by each row block's last split (default) or as its own launch (whole
    head dims per program, or in chunks of 8; split by split, or as [splits, rows, dims] tiles: at
    256 loads in several split steps and rows spread over programs; None: tiled, as one 16-row
    block holds these 12 rows), over split counts around the
    combine's grouped loads; repeated calls find the arrival counters zeroed."""
    n, hq, hkv, d, context, kv_len = 6, 4, 2, 16, 300, 320
    mask = tree_mask(n, context, kv_len, seed=2).to(DEVICE)
    config = AttentionConfig(fold_combine=fold, combine_loads=loads, combine_block_d=block_d, combine_tiled=tiled)
    for seed in range(2):
        q, k, v = inputs(n, hq, hkv, d, kv_len, torch.float32, seed=seed)
        got = masked_attention(q, k, v, mask, d**-0.5, splits=splits, config=config)
        torch.testing.assert_close(got.double(), reference(q, k, v, mask, d**-0.5).to(got.device), atol=2e-5, rtol=1e-4)


def test_key_range():
    mask = torch.tensor([[0, 1, 1, 0, 0], [1, 0, 0, 0, 1], [0, 0, 0, 1, 0]], dtype=torch.bool)
    assert key_range(mask).tolist() == [[1, 3], [0, 5], [3, 4]]


def test_sliding_window_rows_skip_the_early_keys():
    """Each query sees only a window of 30 keys ending at its own position (the drafter's sliding
    layers): programs start past the key blocks none of their rows sees."""
    n, kv_len = 20, 300
    q, k, v = inputs(n, 4, 2, 16, kv_len, torch.float32, seed=3)
    own = 250 + torch.arange(n)
    cols = torch.arange(kv_len)
    mask = ((cols[None, :] <= own[:, None]) & (cols[None, :] > own[:, None] - 30)).to(DEVICE)
    for splits in (1, 2, 5):
        got = masked_attention(q, k, v, mask, 0.25, splits=splits)
        torch.testing.assert_close(got.double(), reference(q, k, v, mask, 0.25).to(got.device), atol=2e-5, rtol=1e-4)


def test_split_that_sees_nothing():
    """Keys split four ways where every query sees only the last 10 keys: three splits see
    nothing, and must not contribute (or turn the output into NaN)."""
    n, kv_len = 3, 200
    q, k, v = inputs(n, 4, 2, 16, kv_len, torch.float32, seed=1)
    mask = torch.zeros(n, kv_len, dtype=torch.bool, device=DEVICE)
    mask[:, -10:] = True
    got = masked_attention(q, k, v, mask, 0.25, splits=4)
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, 0.25).to(got.device), atol=2e-5, rtol=1e-4)


def test_plan_fills_the_gpu_with_splits():
    assert plan(rows=4, kv_heads=8, kv_len=513, sms=132) == (16, 9)  # one key block per split
    assert plan(rows=4, kv_heads=8, kv_len=8192, sms=132) == (16, 33)
    block_m, splits = plan(rows=257 * 4, kv_heads=8, kv_len=769, sms=132)
    assert block_m == 64 and splits == 1  # 136 programs: a second split would start a third wave
    # Whole waves: 8 programs split 16 ways fill 128 of 132 SMs once (17 would need a second wave).
    assert plan(rows=64, kv_heads=8, kv_len=131072, sms=132, config=replace(LONG, programs_per_sm=1)) == (128, 16)


def test_tiling_by_shape():
    assert tiling(rows=4, kv_len=131072, head_dim=128) is DEFAULT  # one query: bandwidth-bound
    assert tiling(rows=260, kv_len=1024, head_dim=128) is DEFAULT  # a short context
    # LONG's tiles do not fit at 256; 64-row blocks there fit one program an SM
    assert tiling(rows=102, kv_len=32768, head_dim=256) is MID_256 and MID_256.programs_per_sm == 1
    assert tiling(rows=6, kv_len=8448, head_dim=256) is DEFAULT  # 16-row blocks: two fit an SM
    assert tiling(rows=390, kv_len=1024, head_dim=256).block_m == 32
    assert tiling(rows=1542, kv_len=1024, head_dim=256).block_n == 32
    assert tiling(rows=390, kv_len=8448, head_dim=256) is LONG_256  # many rows over a long context
    assert LONG_256.programs_per_sm == 1
    assert [tiling(rows, 32768, 128).programs_per_sm for rows in (68, 260, 1028)] == [1, 2, 4]
    assert tiling(rows=1028, kv_len=32768, head_dim=128).block_m == LONG.block_m


@pytest.mark.parametrize("n,context", [(17, 4200), (40, 4500)])
def test_long_tiling_equals_reference(n, context):
    """The LONG tiling (chosen by shape past LONG_KV_MIN keys) in Triton's interpreter."""
    kv_len = context + n + 7
    q, k, v = inputs(n, 8, 2, 16, kv_len, torch.float32, seed=n)
    mask = tree_mask(n, context, kv_len, seed=n).to(DEVICE)
    assert tiling(n * 4, kv_len, 16).block_m == LONG.block_m
    assert tiling(n * 4, kv_len, 16, element_bytes=4) is DEFAULT
    got = masked_attention(q, k, v, mask[:, context:context + n].contiguous(), 0.25,
                           prefix_len=torch.tensor(context, device=DEVICE), config=tiling(n * 4, kv_len, 16))
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, 0.25).to(got.device), atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("n", [1, 17, 65, 129, 257, 1025])
def test_qwen3_heads_bf16(n, fold):
    context = 512
    kv_len = context + n + 30
    q, k, v = inputs(n, 32, 8, 128, kv_len, torch.bfloat16, seed=n, strided_cache=True)
    mask = tree_mask(n, context, kv_len, seed=n).to(DEVICE)
    prefix = torch.tensor(context, device=DEVICE)
    want = reference(q, k, v, mask, 128**-0.5)
    config = AttentionConfig(fold_combine=fold)
    for _ in range(3):  # many programs race to the arrival counters: every repeat must combine right
        got = masked_attention(q, k, v, mask, 128**-0.5, config=config)
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
        block = masked_attention(q, k, v, mask[:, context:context + n], 128**-0.5, config=config, prefix_len=prefix)
        torch.testing.assert_close(block.double(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_long_context_many_splits_bf16():
    """An autoregressive step over 8000 cached keys: 33 splits per row block, combined in the kernel."""
    kv_len = 8000
    q, k, v = inputs(1, 32, 8, 128, kv_len, torch.bfloat16, seed=5, strided_cache=True)
    mask = torch.ones(1, kv_len, dtype=torch.bool, device=DEVICE)
    got = masked_attention(q, k, v, mask, 128**-0.5)
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, 128**-0.5), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("context,n,heads", [(32768, 65, (32, 8, 128)), (32768, 257, (32, 8, 128)),
                                             (131072, 17, (32, 8, 128)), (131072, 65, (32, 8, 128)),
                                             (8192, 65, (24, 4, 256)), (8192, 257, (24, 4, 256))])
def test_long_context_tree_bf16_and_graph(context, n, heads):
    """A tree's verify over a long cached context in the engine's form (prefix length + block
    mask): the prefix's key blocks go through the unmasked loop, the tree's through the masked one;
    equal to float64 attention, and a CUDA-graph replay equals the eager call exactly."""
    from ddtree.engine import capture_graph

    hq, hkv, d = heads
    kv_len = -(-(context + n) // 256) * 256  # the engine's KV bucket
    q, k, v = inputs(n, hq, hkv, d, kv_len, torch.bfloat16, seed=context + n, strided_cache=True)
    mask = tree_mask(n, context, kv_len, seed=n).to(DEVICE)
    block, prefix = mask[:, context:context + n].contiguous(), torch.tensor(context, device=DEVICE)
    eager = masked_attention(q, k, v, block, d**-0.5, prefix_len=prefix)
    torch.testing.assert_close(eager.double(), reference(q, k, v, mask, d**-0.5), atol=2e-2, rtol=2e-2)
    graph, out = capture_graph(lambda: masked_attention(q, k, v, block, d**-0.5, prefix_len=prefix))
    graph.replay()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("n,context", [(40, 90), (150, 90), (40, 4200)])
def test_head_dim_256_tilings_equal_reference(n, context):
    """head_dim 256 with many rows: 32-row blocks (n = 40, 160 rows) or 32-key blocks (n = 150),
    LONG_256 over a long context."""
    kv_len = context + n
    q, k, v = inputs(n, 8, 2, 256, kv_len, torch.float32, seed=n)
    mask = tree_mask(n, context, kv_len, seed=n).to(DEVICE)
    config = None
    if context >= 4096:
        assert tiling(n * 4, kv_len, 256) is LONG_256
        assert tiling(n * 4, kv_len, 256, element_bytes=4) is not LONG_256  # float32 tiles would not fit
        config = LONG_256 if not CUDA else None  # on a GPU, float32 takes the tiles that fit
    got = masked_attention(q, k, v, mask[:, context:context + n].contiguous(), 0.0625,
                           prefix_len=torch.tensor(context, device=DEVICE), config=config)
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, 0.0625).to(got.device), atol=2e-5, rtol=1e-4)


def library_partials(q, k, v, keys, splits, scale):
    """`attention_libraries.cudnn_prefix`'s outputs made in float64 by PyTorch: each chunk's normalised
    output [splits, Hkv, rows, D] in q's dtype and its natural-log denominators [splits, Hkv, rows]."""
    n, hq, d = q.shape
    hkv = k.shape[1]
    rows = n * (hq // hkv)
    qf = q.double().view(n, hkv, hq // hkv, d).permute(1, 0, 2, 3).reshape(hkv, rows, d)
    chunk = keys // splits
    outs, lses = [], []
    for s in range(splits):
        kk = k[s * chunk:(s + 1) * chunk].double().transpose(0, 1)  # [Hkv, chunk, D]
        vv = v[s * chunk:(s + 1) * chunk].double().transpose(0, 1)
        logits = qf @ kk.transpose(1, 2) * scale
        outs.append(torch.softmax(logits, -1) @ vv)
        lses.append(torch.logsumexp(logits, -1))
    return torch.stack(outs).to(q.dtype), torch.stack(lses).float()


@pytest.mark.parametrize("n,hq,hkv,d,context,lib_splits", [
    (9, 4, 2, 16, 300, 3),    # 36 rows
    (40, 4, 1, 16, 520, 4),   # 160 rows
    (5, 2, 2, 32, 200, 1),
    (6, 4, 2, 16, 700, 7),    # splits past the prefix: no key of their own
])
def test_partials_with_the_block_merge_alone(n, hq, hkv, d, context, lib_splits):
    """The Gluon kernel's partials with the tree's block in its first split (here its float64
    reference, `prefix_attention_sm90.reference`) merged by the combine launch with no split of its
    own (`_merge_library`): the whole attention, against float64."""
    from ddtree.kernels import attention_libraries
    from ddtree.kernels.prefix_attention_sm90 import reference as gluon_reference

    kv_len = context + n + 11
    q, k, v = inputs(n, hq, hkv, d, kv_len, torch.float32, seed=n + context, strided_cache=True)
    mask = tree_mask(n, context, kv_len, seed=n).to(DEVICE)
    block = mask[:, context:context + n].contiguous()
    max_keys = context + 64 if lib_splits < 7 else 2 * context
    o, lse = gluon_reference(q, k, v, context, max_keys, lib_splits, d**-0.5, block=block)
    got = attention_libraries._merge_library(q, o.to(q.dtype), lse.float(), n, None)
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, d**-0.5).to(got.device), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n,hq,hkv,d,context,library_keys,lib_splits", [
    (9, 4, 2, 16, 300, 128, 1),   # 36 rows: one row block; the kernel's part starts mid-prefix
    (9, 4, 2, 16, 300, 256, 4),   # 44 keys of prefix left to the kernel: no whole key block
    (40, 4, 1, 16, 520, 384, 3),  # 160 rows: three row blocks
    (5, 2, 2, 32, 200, 200, 2),   # the library takes the whole prefix: the kernel sees the tree alone
])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_library_partials_merge_in_the_combine(n, hq, hkv, d, context, library_keys, lib_splits, splits):
    """Partial sums of the prefix's first keys made elsewhere (cuDNN on a GPU; here PyTorch, in
    `cudnn_prefix`'s layout) merged by the kernel's combine launch with its own part (the rest of
    the prefix and the tree's block): the whole attention, against float64."""
    kv_len = context + n + 11
    q, k, v = inputs(n, hq, hkv, d, kv_len, torch.float32, seed=n + library_keys, strided_cache=True)
    mask = tree_mask(n, context, kv_len, seed=n).to(DEVICE)
    o, lse = library_partials(q, k, v, library_keys, lib_splits, d**-0.5)
    got = masked_attention(q, k, v, mask[:, context:context + n].contiguous(), d**-0.5, splits=splits,
                           prefix_len=torch.tensor(context, device=DEVICE), prefix_partials=(o, lse, library_keys))
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, d**-0.5).to(got.device), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n,hq,hkv,d,context,lib_splits", [
    (9, 4, 2, 16, 300, 3),    # 36 rows: one row block
    (40, 4, 1, 16, 520, 4),   # 160 rows: three row blocks
    (5, 2, 2, 32, 200, 1),
])
@pytest.mark.parametrize("splits", [1, 2, None])
def test_whole_prefix_summed_elsewhere_leaves_the_kernel_the_block(n, hq, hkv, d, context, lib_splits, splits):
    """Partial sums over the whole prefix (the Gluon kernel's on a GPU; here PyTorch's), its length
    only on the device (P None): the kernel reads the block's columns alone, from the prefix length
    on, and its combine merges both: the whole attention, against float64."""
    kv_len = context + n + 11
    q, k, v = inputs(n, hq, hkv, d, kv_len, torch.float32, seed=n + context, strided_cache=True)
    mask = tree_mask(n, context, kv_len, seed=n).to(DEVICE)
    o, lse = library_partials(q, k, v, context, lib_splits, d**-0.5)
    got = masked_attention(q, k, v, mask[:, context:context + n].contiguous(), d**-0.5, splits=splits,
                           prefix_len=torch.tensor(context, device=DEVICE), prefix_partials=(o, lse, None))
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, d**-0.5).to(got.device), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n,hq,hkv,d,context,lib_splits", [
    (9, 4, 2, 16, 300, 1),    # 36 rows: one row block
    (40, 4, 1, 16, 520, 4),   # 160 rows: three row blocks
    (6, 2, 2, 32, 200, 2),
])  # (the prefix's partials split it evenly: `library_partials` drops a remainder)
def test_a_causal_block_merges_with_the_whole_prefix(n, hq, hkv, d, context, lib_splits, monkeypatch):
    """A prefill chunk's own keys (`_causal_block`: cuDNN's causal attention on a GPU, here float64 in
    its layout, head-major) merged with the whole prefix's partials (the Gluon kernel's layout, rows
    token-major) by the combine launch: the chunk's attention over prefix + itself causally."""
    from ddtree.kernels import attention_libraries

    def causal(q, k, v, scale):  # cuDNN's outputs, in float64: o [Hq, N, D], lse [Hq, N]
        group = q.shape[1] // k.shape[1]
        logits = torch.einsum("nhd,thd->hnt", q.double(), k.double().repeat_interleave(group, 1)) * scale
        logits = logits.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        o = torch.einsum("hnt,thd->hnd", torch.softmax(logits, -1), v.double().repeat_interleave(group, 1))
        return o.to(q.dtype), torch.logsumexp(logits, -1).float()

    monkeypatch.setattr(attention_libraries, "_cudnn_causal", causal)
    kv_len = context + n + 11
    q, k, v = inputs(n, hq, hkv, d, kv_len, torch.float32, seed=n + context, strided_cache=True)
    o, lse = library_partials(q, k, v, context, lib_splits, d**-0.5)
    got = attention_libraries._causal_block(q, k[context:context + n], v[context:context + n], d**-0.5, (o, lse, None))
    mask = torch.zeros(n, kv_len, dtype=torch.bool, device=DEVICE)
    mask[:, :context] = True
    mask[:, context:context + n] = torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril()
    torch.testing.assert_close(got.double(), reference(q, k, v, mask, d**-0.5).to(got.device), atol=2e-5, rtol=1e-4)


def test_cudnn_splits_by_head_dim():
    """16 chunks at head_dim <= 128; one wave of 128-row programs at 256 (the H200's best); never
    chunks under 512 keys; always a power of two."""
    from ddtree.kernels.attention_libraries import cudnn_splits
    assert cudnn_splits(rows=260, kv_heads=8, head_dim=128, keys=32768, sms=132) == 16
    assert cudnn_splits(rows=390, kv_heads=4, head_dim=256, keys=8192, sms=132) == 8
    assert cudnn_splits(rows=1542, kv_heads=4, head_dim=256, keys=8192, sms=132) == 2
    assert cudnn_splits(rows=102, kv_heads=4, head_dim=256, keys=32768, sms=132) == 16
    assert cudnn_splits(rows=260, kv_heads=8, head_dim=128, keys=3072, sms=132) == 4


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("context,n,heads", [(32768, 65, (32, 8, 128)), (32768, 257, (32, 8, 128)),
                                             (131072, 65, (32, 8, 128)), (8192, 65, (24, 4, 256)),
                                             (8192, 257, (24, 4, 256)), (32768, 257, (24, 4, 256))])
def test_cudnn_prefix_bf16_and_graph(context, n, heads, monkeypatch):
    """A tree's verify over a long context with the prefix's first keys through cuDNN (switched on,
    min_prefix given): equal to float64 attention and close to the kernel alone; a CUDA-graph
    replay equals the eager call exactly, and follows the cache's contents."""
    from ddtree.engine import capture_graph
    from ddtree.kernels import attention_libraries

    hq, hkv, d = heads
    kv_len = -(-(context + n) // 256) * 256
    q, k, v = inputs(n, hq, hkv, d, kv_len, torch.bfloat16, seed=context + n, strided_cache=True)
    mask = tree_mask(n, context, kv_len, seed=n).to(DEVICE)
    block, prefix = mask[:, context:context + n].contiguous(), torch.tensor(context, device=DEVICE)
    monkeypatch.setattr(attention_libraries, "CUDNN_PREFIX", True)
    monkeypatch.setattr(attention_libraries, "GLUON_PREFIX", False)  # it would take the whole prefix first
    least = context - 300 if context - 300 >= attention_libraries.CUDNN_MIN_KEYS else context
    assert attention_libraries._cudnn_keys(q, k, least) == least // 1024 * 1024
    run = lambda: masked_attention(q, k, v, block, d**-0.5, prefix_len=prefix, min_prefix=least)  # noqa: E731
    eager = run()
    want = reference(q, k, v, mask, d**-0.5)
    torch.testing.assert_close(eager.double(), want, atol=2e-2, rtol=2e-2)
    alone = masked_attention(q, k, v, block, d**-0.5, prefix_len=prefix)
    assert (eager.double() - want).abs().max() <= 2 * (alone.double() - want).abs().max() + 1e-3
    graph, out = capture_graph(run)
    graph.replay()
    assert torch.equal(out, eager)
    k[: context // 2].mul_(-1)  # the graph reads the cache as it is at replay
    graph.replay()
    assert torch.equal(out, run())


def test_a_gluon_kernel_that_fails_leaves_the_triton_kernel_to_attend(monkeypatch, caplog):
    """Where the Gluon prefix kernel fails to build or launch (a Triton whose Gluon differs), the
    verify's attention goes on through the Triton kernel, equal to float64, with a warning; later
    calls at that dtype and head_dim do not try it again."""
    from ddtree.kernels import attention_libraries, prefix_attention_sm90

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("this Gluon does not build the kernel")

    monkeypatch.setattr(attention_libraries, "_GLUON_FAILED", set())
    monkeypatch.setattr(attention_libraries, "_gluon_prefix",
                        lambda q, k, v, min_prefix: (q.dtype, q.shape[-1]) not in attention_libraries._GLUON_FAILED)
    monkeypatch.setattr(prefix_attention_sm90, "prefix_attention", failing)
    n, hq, hkv, d, context = 9, 4, 2, 16, 300
    kv_len = context + n + 11
    q, k, v = inputs(n, hq, hkv, d, kv_len, torch.float32, seed=3)
    mask = tree_mask(n, context, kv_len, seed=n).to(DEVICE)
    block = mask[:, context:context + n].contiguous()
    prefix = torch.tensor(context, device=DEVICE)
    for _ in range(2):
        got = masked_attention(q, k, v, block, d**-0.5, prefix_len=prefix, min_prefix=context)
        torch.testing.assert_close(got.double(), reference(q, k, v, mask, d**-0.5).to(got.device), atol=2e-5, rtol=1e-4)
    assert calls == [1] and "the Gluon prefix kernel failed" in caplog.text
