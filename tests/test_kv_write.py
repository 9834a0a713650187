"""`kernels.kv_write.write_kv` equals `index_copy_`: strided sources (views of a fused projection's
rows), slots in any order, head sizes that are not powers of two, and only the named slots change.
`compact_kv` equals gathering then writing (`index_select` + `index_copy_`), overlapping moves
included. On the CPU through Triton's interpreter; on a GPU also at Qwen3-8B's KV layout in bf16."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest has put Triton in interpreter mode
from ddtree.kernels.kv_write import compact_kv, supported, write_kv  # noqa: E402
from ddtree.tree import build_tree, walk  # noqa: E402
from ddtree.kv_cache import KVCache  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def projected(n, hq, hkv, d, dtype, seed):
    """k, v [n, hkv, d] as views of one fused [n, (hq + 2 hkv) * d] projection (strided rows)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen).to(DEVICE, dtype)
    _, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return k.view(n, hkv, d), v.view(n, hkv, d)


CASES = [  # n, Hq, Hkv, D, slots in the cache
    (1, 4, 2, 16, 8),
    (7, 4, 2, 32, 20),
    (5, 6, 3, 24, 16),  # Hkv and D not powers of two
    (12, 2, 1, 16, 40),
]


@pytest.mark.parametrize("n,hq,hkv,d,slots", CASES)
def test_write_equals_index_copy(n, hq, hkv, d, slots):
    k, v = projected(n, hq, hkv, d, torch.float32, seed=n)
    gen = torch.Generator().manual_seed(100 + n)
    where = torch.randperm(slots, generator=gen)[:n].to(DEVICE)
    before = torch.randn(2, slots, hkv, d, generator=gen).to(DEVICE)
    ours, ref = before.clone(), before.clone()
    assert supported(ours[0], k)
    write_kv(ours[0], ours[1], where, k, v)
    ref[0].index_copy_(0, where, k)
    ref[1].index_copy_(0, where, v)
    assert torch.equal(ours, ref)
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[where] = False
    assert torch.equal(ours[:, untouched], before[:, untouched])


def test_cache_write_returns_the_written_layer():
    """`KVCache.write` (the kernel on CUDA, index_copy_ elsewhere) stores into the named layer only."""
    cache = KVCache(layers=3, slots=16, kv_heads=2, head_dim=16, device=DEVICE, dtype=torch.float32)
    k, v = projected(4, 4, 2, 16, torch.float32, seed=3)
    slots = torch.tensor([9, 2, 5, 11], device=DEVICE)
    keys, values = cache.write(1, slots, k, v, kv_len=12)
    assert keys.shape == (12, 2, 16)
    assert torch.equal(cache.k[1, slots], k) and torch.equal(cache.v[1, slots], v)
    assert torch.equal(keys[slots], k) and torch.equal(values[slots], v)
    assert not cache.k[0].any() and not cache.k[2].any() and not cache.v[0].any()


def test_write_layers_equals_index_copy_per_layer():
    """`KVCache.write_layers`: N tokens' entries of every layer at once (the drafter's context), from
    views of one [N, L * 2 * Hkv * D] projection, as one index_copy_ per layer would store them."""
    n, layers, hkv, d = 5, 3, 2, 16
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn(n, layers * 2 * hkv * d, generator=gen).to(DEVICE).view(n, layers, 2, hkv, d)
    k, v = kv[:, :, 0], kv[:, :, 1]
    slots = torch.tensor([7, 1, 12, 3, 9], device=DEVICE)
    cache = KVCache(layers=layers, slots=16, kv_heads=hkv, head_dim=d, device=DEVICE, dtype=torch.float32)
    ref = KVCache(layers=layers, slots=16, kv_heads=hkv, head_dim=d, device=DEVICE, dtype=torch.float32)
    write_kv(cache.k, cache.v, slots, k, v)  # the kernel, on any device
    for layer in range(layers):
        ref.k[layer].index_copy_(0, slots, k[:, layer])
        ref.v[layer].index_copy_(0, slots, v[:, layer])
    assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)
    other = KVCache(layers=layers, slots=16, kv_heads=hkv, head_dim=d, device=DEVICE, dtype=torch.float32)
    other.write_layers(slots, k, v)  # the kernel on CUDA, index_copy_ elsewhere
    assert torch.equal(other.k, ref.k) and torch.equal(other.v, ref.v)
    with pytest.raises(ValueError, match="layers"):
        other.write_layers(slots, k[:, :2], v[:, :2])


def test_kernel_matches_at_qwen3_kv_layout():
    """bf16, 8 KV heads x 128 (the kernel path on a GPU; in the interpreter a few tokens only)."""
    n = 257 if DEVICE == "cuda" else 3
    k, v = projected(n, 32, 8, 128, torch.bfloat16, seed=7)
    cache = torch.zeros(2, 1100, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    ref = cache.clone()
    slots = 512 + torch.arange(n, device=DEVICE)
    write_kv(cache[0], cache[1], slots, k, v)
    ref[0].index_copy_(0, slots, k)
    ref[1].index_copy_(0, slots, v)
    assert torch.equal(cache, ref)


def reference_compact(cache: torch.Tensor, start: int, order: torch.Tensor) -> torch.Tensor:
    """cache [L, S, H, D] with slot start + j taking slot start + order[j] (all read before any write)."""
    out = cache.clone()
    out[:, start + torch.arange(order.shape[0], device=cache.device)] = cache[:, start + order]
    return out


@pytest.mark.parametrize("layers,slots,hkv,d,seed", [(3, 64, 2, 16, 0), (2, 80, 3, 24, 1), (1, 300, 8, 128, 2)])
def test_compact_equals_gather_then_write(layers, slots, hkv, d, seed):
    """Orders from real walks (accepted path first, overlapping moves: a source slot is another
    move's destination) and random permutations; only slots start .. start + M - 1 change."""
    gen = torch.Generator().manual_seed(seed)
    for trial in range(4):
        n = 17 if trial < 2 else 9
        logp = torch.log_softmax(torch.randn(4, 7, generator=gen) * 3, dim=-1)
        tree = build_tree(logp, torch.tensor(1), n - 1)
        choices = torch.where(torch.rand(n, generator=gen) < 0.7, tree.tokens[torch.randint(0, n, (n,), generator=gen)], 0)
        choices[tree.parents.clamp(min=0)] = tree.tokens  # some nodes match their parent's choice
        order = walk(tree, choices).order if trial % 2 == 0 else torch.randperm(n, generator=gen)
        keep = order[: min(n, 8)]
        start = int(torch.randint(0, slots - n, (1,), generator=gen))
        cache = torch.randn(2, layers, slots, hkv, d, generator=gen).to(DEVICE)
        expected = [reference_compact(cache[i], start, keep.to(DEVICE)) for i in range(2)]
        compact_kv(cache[0], cache[1], torch.tensor(start, device=DEVICE), keep.to(DEVICE))
        assert torch.equal(cache[0], expected[0]) and torch.equal(cache[1], expected[1]), (trial, keep.tolist())


@pytest.mark.parametrize("on_cache", [False, True], ids=["kernel", "cache"])
def test_compact_of_many_spans_equals_each_span_alone(on_cache):
    """A batched round's rows compacted at once (start [R], order [R, M]; spans that do not
    overlap): the same as compacting each row's span alone, through the kernel or `KVCache.compact`
    (the kernel on CUDA, index_select + index_copy_ elsewhere)."""
    gen = torch.Generator().manual_seed(7)
    layers, hkv, d, rows, m = 2, 2, 16, 3, 9
    starts = torch.tensor([4, 40, 77])
    orders = torch.stack([torch.randperm(m, generator=gen) for _ in range(rows)])
    cache = torch.randn(2, layers, 100, hkv, d, generator=gen).to(DEVICE)
    expected = cache.clone()
    for r in range(rows):
        expected = torch.stack([reference_compact(expected[i], int(starts[r]), orders[r].to(DEVICE)) for i in range(2)])
    if on_cache:
        kv = KVCache(layers=layers, slots=100, kv_heads=hkv, head_dim=d, device=DEVICE, dtype=torch.float32)
        kv.k.copy_(cache[0])
        kv.v.copy_(cache[1])
        kv.compact(starts.to(DEVICE), orders.to(DEVICE))
        got = torch.stack([kv.k, kv.v])
    else:
        compact_kv(cache[0], cache[1], starts.to(DEVICE), orders.to(DEVICE))
        got = cache
    assert torch.equal(got, expected)


def test_cache_compact_uses_the_same_moves():
    """`KVCache.compact` (the kernel on CUDA, index_select + index_copy_ elsewhere) on a cache whose
    slots hold their own index: slot start + j ends up holding start + order[j]."""
    cache = KVCache(layers=2, slots=40, kv_heads=1, head_dim=16, device=DEVICE, dtype=torch.float32)
    cache.k[:] = torch.arange(40, device=DEVICE, dtype=torch.float32)[None, :, None, None]
    cache.v[:] = -cache.k
    order = torch.tensor([0, 3, 4, 9, 1, 2], device=DEVICE)
    cache.compact(torch.tensor(20, device=DEVICE), order)
    assert cache.k[0, 20:26, 0, 0].tolist() == [20, 23, 24, 29, 21, 22]
    assert torch.equal(cache.v, -cache.k)
    assert cache.k[1, :20, 0, 0].tolist() == list(range(20)) and cache.k[1, 26:, 0, 0].tolist() == list(range(26, 40))


def test_cache_copy_span_moves_a_row_in_every_layer():
    """`KVCache.copy_span`: slots [src, src + L) land at [dst, dst + L) in every layer, keys and
    values; nothing else changes; overlapping spans copy as if through a temporary."""
    cache = KVCache(layers=3, slots=40, kv_heads=2, head_dim=16, device=DEVICE, dtype=torch.float32)
    cache.k[:] = torch.arange(40, device=DEVICE, dtype=torch.float32)[None, :, None, None]
    cache.k += 100 * torch.arange(3, device=DEVICE, dtype=torch.float32)[:, None, None, None]
    cache.v[:] = -cache.k
    before = cache.k.clone()
    cache.copy_span(30, 5, 7)  # a later row into an earlier one
    expected = before.clone()
    expected[:, 5:12] = before[:, 30:37]
    assert torch.equal(cache.k, expected) and torch.equal(cache.v, -expected)
    cache.copy_span(5, 8, 6)  # overlapping: slots 8..13 take what 5..10 held
    expected[:, 8:14] = expected[:, 5:11].clone()
    assert torch.equal(cache.k, expected) and torch.equal(cache.v, -expected)
    cache.copy_span(0, 20, 0)  # nothing to copy
    assert torch.equal(cache.k, expected)
