"""`kernels.gdn_tree` equals the gated delta rule's references: the tree kernel equals
`models.gated_deltanet.tree_gated_delta` and, in float64, each node's root path run through the
token loop from the state (an oracle independent of the chunked form); the token-loop kernel
equals `recurrent_gated_delta` and the float64 loop, with the state updated in place to the state
after `length` tokens (a device tensor, an int, or all).

Trees: `build_tree` on random draft log-probs (bushy and deep), chains, one node, trees with
padding nodes (a forest); N that is no multiple of the block; grouped value heads (Hv = 2 Hk);
several value tiles per head; ancestor lists in one chunk and in several; bf16 q / k / v; strided
q / k (slices of a fused projection). On the CPU in Triton's interpreter (small heads); on a GPU
also at Qwen3.6-27B's GDN heads (Hk 16, Hv 48, D 128) and inside a CUDA graph.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest has put Triton in interpreter mode
from ddtree.kernels.gdn_tree import (  # noqa: E402
    FoldConfig, RecurrentConfig, TreeConfig, recurrent_gated_delta, supported, tree_config, tree_gated_delta)
from ddtree.models import gated_deltanet as ref  # noqa: E402
from ddtree.tree import build_chain, build_tree  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def inputs(n, hk, hv, dk, dv, seed, dtype=torch.float32, hard=False, strided=False):
    """q, k [n, hk, dk] normalised; v [n, hv, dv]; g, beta [n, hv]; state [hv, dk, dv]. `hard`:
    nearly equal keys, beta near 1, decay near 1 (the triangular system's worst conditioning)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hk, dk, generator=gen)
    k = torch.randn(n, hk, dk, generator=gen)
    if hard:
        k = torch.randn(1, hk, dk, generator=gen) + 0.05 * k
    q, k = ref.normalize_qk(q, k)
    v = torch.randn(n, hv, dv, generator=gen)
    if hard:
        g = -0.01 * torch.rand(n, hv, generator=gen)
        beta = 0.9 + 0.1 * torch.rand(n, hv, generator=gen)
    else:  # as the model's: -exp(A_log) softplus(.) and sigmoid(.)
        g = -torch.nn.functional.softplus(torch.randn(n, hv, generator=gen)) * torch.rand(hv, generator=gen)
        beta = torch.sigmoid(torch.randn(n, hv, generator=gen))
    state = 0.5 * torch.randn(hv, dk, dv, generator=gen)
    q, k, v, g, beta, state = (t.to(DEVICE) for t in (q, k, v, g, beta, state))
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if strided:  # q and k as slices of one [n, 2 hk, dk + 16] buffer
        buf = torch.zeros(n, 2 * hk, dk + 16, dtype=dtype, device=DEVICE)
        buf[:, :hk, :dk], buf[:, hk:, :dk] = q, k
        q, k = buf[:, :hk, :dk], buf[:, hk:, :dk]
    return [q, k, v, g, beta, state]


def tree_mask(n, seed, vocab=50, temperature=3.0, depths=15):
    """The ancestor-or-self mask of a `build_tree` tree of n nodes (padding nodes where the
    vocabulary is too small for n: visible only to themselves)."""
    gen = torch.Generator().manual_seed(seed)
    logp = torch.log_softmax(torch.randn(depths, vocab, generator=gen) * temperature, dim=-1)
    return build_tree(logp, torch.tensor(1), n - 1).visible.to(DEVICE)


def chain_mask(n):
    return build_chain(torch.arange(n - 1), torch.tensor(1)).visible.to(DEVICE)


def _step(s, q, k, v, g, beta, group):
    """One token of the loop in float64 for every row: s [R, Hv, Dk, Dv]; q, k [R, Hk, Dk]; v [R, Hv, Dv]."""
    q = q.repeat_interleave(group, dim=1)
    k = k.repeat_interleave(group, dim=1)
    s = s * g.exp()[:, :, None, None]
    delta = beta[:, :, None] * (v - torch.einsum("rhkv,rhk->rhv", s, k))
    s = s + k[..., None] * delta[:, :, None, :]
    return s, torch.einsum("rhkv,rhk->rhv", s, q)


def path_oracle(q, k, v, g, beta, visible, state):
    """float64: node i's output is the token loop over its root-to-i path from `state`. Parents
    are the nearest strict ancestors; nodes are run level by level from their parents' states."""
    q, k, v, g, beta, state = (t.double() for t in (q, k, v, g, beta, state))
    n, group = q.shape[0], v.shape[1] // k.shape[1]
    idx = torch.arange(n, device=q.device)
    strict = visible & (idx[None, :] < idx[:, None])
    parent = torch.where(strict, idx[None, :], -1).amax(1)
    depth = strict.sum(1)
    states = torch.empty(n, *state.shape, dtype=torch.float64, device=q.device)
    out = torch.empty(n, *v.shape[1:], dtype=torch.float64, device=q.device)
    for d in range(int(depth.max()) + 1):
        rows = (depth == d).nonzero()[:, 0]
        base = torch.where((parent[rows] >= 0)[:, None, None, None], states[parent[rows].clamp(min=0)], state)
        states[rows], out[rows] = _step(base, q[rows], k[rows], v[rows], g[rows], beta[rows], group)
    return out


def loop_oracle(q, k, v, g, beta, state, length):
    """float64 token loop -> (o [T, Hv, Dv], the state after the first `length` tokens)."""
    t = q.shape[0]
    length = t if length is None else int(length)
    live = (torch.arange(t, device=q.device) < length)[:, None].double()
    q, k, v, state = (x.double() for x in (q, k, v, state))
    g, beta = g.double() * live, beta.double() * live
    s = state[None]
    outs = []
    for i in range(t):
        s, o = _step(s, q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], v.shape[1] // k.shape[1])
        outs.append(o[0])
    return torch.stack(outs), s[0]


def assert_matches(got, want, rel=1e-4):
    """Max error within `rel` of the reference's largest magnitude, and elementwise close."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    scale = want.abs().max().item()
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * scale, (err, scale)


SMALL = dict(hk=2, hv=4, dk=16, dv=32)  # two value tiles per head with block_v 16
SMALL_CONFIG = TreeConfig(block_v=16, block_w=16)
CHUNKED = TreeConfig(block_v=16, block_c=16, block_w=16)  # several steps over the ancestor lists
ROOTED = TreeConfig(block_v=16, block_w=16, root_first=True)  # node 0 finished before the blocks
ROOTED_CHUNKED = TreeConfig(block_v=16, block_c=16, block_w=16, root_first=True)


def small_tree_case(name: str):
    n, mask = {
        "one": (1, chain_mask(1)),
        "chain17": (17, chain_mask(17)),
        "bushy5": (5, tree_mask(5, seed=1)),
        "deep40": (40, tree_mask(40, seed=2, temperature=8.0)),
        "bushy40": (40, tree_mask(40, seed=3, temperature=1.0)),
        "padded23": (23, tree_mask(23, seed=4, vocab=3, depths=2)),  # 12 real nodes, 11 padding
        "deep33": (33, tree_mask(33, seed=11, temperature=8.0)),  # node 0 and two whole blocks
        "forest30": (30, torch.block_diag(tree_mask(10, seed=12), tree_mask(20, seed=13, temperature=8.0))),
    }[name]
    return n, mask


@pytest.mark.parametrize("name", ["one", "chain17", "bushy5", "deep40", "bushy40", "padded23", "deep33", "forest30"])
@pytest.mark.parametrize("config", [SMALL_CONFIG, CHUNKED, ROOTED, ROOTED_CHUNKED],
                         ids=["one_chunk", "chunked", "root_first", "root_first_chunked"])
def test_tree_equals_references(name, config):
    n, mask = small_tree_case(name)
    q, k, v, g, beta, state = inputs(n, **SMALL, seed=n)
    before = state.clone()
    got = tree_gated_delta(q, k, v, g, beta, mask, state, config)
    assert torch.equal(state, before)  # read only
    assert_matches(got, path_oracle(q, k, v, g, beta, mask, state))
    torch.testing.assert_close(got, ref.tree_gated_delta(q, k, v, g, beta, mask, state), rtol=1e-4, atol=1e-5)


def test_tree_padding_nodes_present():
    """The padded case really has nodes that see only themselves besides the root."""
    _, mask = small_tree_case("padded23")
    assert (mask.sum(1) == 1).sum() > 1


@pytest.mark.parametrize("config", [TreeConfig(block_t=32, block_c=32, block_v=32, block_w=32),
                                    TreeConfig(block_t=16, block_c=32, block_v=16, block_w=64, precision="ieee")])
def test_tree_other_tilings(config):
    n, mask = 40, tree_mask(40, seed=5, temperature=8.0)
    q, k, v, g, beta, state = inputs(n, hk=1, hv=2, dk=32, dv=32, seed=6)
    assert_matches(tree_gated_delta(q, k, v, g, beta, mask, state, config), path_oracle(q, k, v, g, beta, mask, state))


def test_tree_hard_system():
    """Nearly equal keys, beta ~ 1, decay ~ 1 along a chain: the solve must stay forward substitution."""
    n, mask = 17, chain_mask(17)
    q, k, v, g, beta, state = inputs(n, **SMALL, seed=7, hard=True)
    assert_matches(tree_gated_delta(q, k, v, g, beta, mask, state, SMALL_CONFIG),
                   path_oracle(q, k, v, g, beta, mask, state))


def test_tree_bf16_and_strided():
    n, mask = 21, tree_mask(21, seed=8, temperature=8.0)
    q, k, v, g, beta, state = inputs(n, **SMALL, seed=9, dtype=torch.bfloat16, strided=True)
    assert not q.is_contiguous()
    got = tree_gated_delta(q, k, v, g, beta, mask, state, SMALL_CONFIG)
    assert_matches(got, path_oracle(q, k, v, g, beta, mask, state))  # on the same bf16 values


def test_chain_tree_equals_token_loop():
    """A chain's outputs are the token loop's."""
    n = 9
    q, k, v, g, beta, state = inputs(n, **SMALL, seed=10)
    tree = tree_gated_delta(q, k, v, g, beta, chain_mask(n), state, SMALL_CONFIG)
    loop = recurrent_gated_delta(q, k, v, g, beta, state.clone(), None, RecurrentConfig(block_v=16))
    torch.testing.assert_close(tree, loop, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("t,length", [(1, None), (1, "t1"), (5, "t3"), (16, "t0"), (16, "t16"), (16, "t7"), (6, 4)])
def test_recurrent_equals_references(t, length):
    q, k, v, g, beta, state = inputs(t, **SMALL, seed=20 + t)
    if isinstance(length, str):
        length = torch.tensor(int(length[1:]), device=DEVICE)
    s_kernel, s_ref = state.clone(), state.clone()
    got = recurrent_gated_delta(q, k, v, g, beta, s_kernel, length, RecurrentConfig(block_v=16))
    want = ref.recurrent_gated_delta(q, k, v, g, beta, s_ref, length)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_kernel, s_ref, rtol=1e-4, atol=1e-5)
    o64, s64 = loop_oracle(q, k, v, g, beta, state, length)
    assert_matches(got, o64)
    assert_matches(s_kernel, s64)
    if length is not None and int(length) == 0:
        assert torch.equal(s_kernel, state)  # no live row: the state stays bit for bit


@pytest.mark.parametrize("length", [None, "t131"])
def test_recurrent_over_a_prefill_equals_the_chunked_form(length):
    """A prefill (150 tokens, over two of the PyTorch form's 64-token chunks, from a zero state; a
    padded one stops at its length): the token-loop kernel, which runs every prefill with the
    kernels, equals `chunked_gated_delta`, the form it replaces there, and the float64 loop."""
    q, k, v, g, beta, state = inputs(150, **SMALL, seed=50)
    state.zero_()
    if length is not None:
        length = torch.tensor(int(length[1:]), device=DEVICE)
    s_kernel, s_chunked = state.clone(), state.clone()
    got = recurrent_gated_delta(q, k, v, g, beta, s_kernel, length)
    want = ref.chunked_gated_delta(q, k, v, g, beta, s_chunked, length)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_kernel, s_chunked, rtol=1e-4, atol=1e-5)
    o64, s64 = loop_oracle(q, k, v, g, beta, state, length)
    assert_matches(got, o64)
    assert_matches(s_kernel, s64)


def test_recurrent_rows_past_length_leave_state():
    """The state after (T tokens, length L) is bit for bit the state after the first L tokens alone."""
    q, k, v, g, beta, state = inputs(12, **SMALL, seed=30)
    a, b = state.clone(), state.clone()
    recurrent_gated_delta(q, k, v, g, beta, a, torch.tensor(5, device=DEVICE))
    recurrent_gated_delta(q[:5], k[:5], v[:5], g[:5], beta[:5], b)
    assert torch.equal(a, b)


def test_recurrent_bf16():
    q, k, v, g, beta, state = inputs(16, **SMALL, seed=31, dtype=torch.bfloat16, strided=True)
    s = state.clone()
    got = recurrent_gated_delta(q, k, v, g, beta, s, torch.tensor(11, device=DEVICE))
    o64, s64 = loop_oracle(q, k, v, g, beta, state, 11)
    assert_matches(got, o64)
    assert_matches(s, s64)


def test_supported():
    q, k, v, g, beta, state = inputs(3, **SMALL, seed=40)
    assert supported(q, k, v, state)
    assert not supported(q[..., :12], k[..., :12], v)  # Dk not a power of two >= 16
    assert not supported(q, k, v[:, :3])  # 3 value heads over 2 key heads
    assert not supported(q, k, v, state.double())
    # per size: a third pipeline stage throughout, the prepare launch's register cap above 32 nodes
    assert tree_config(17).prepare_registers is None and tree_config(17).num_stages == 3
    assert tree_config(33).prepare_registers == 128 and tree_config(1025).num_stages == 3
    assert tree_config(65).precision == tree_config(65).solve_precision == "tf32x3"
    assert tree_config(65, torch.bfloat16).precision == tree_config(17, torch.float16).solve_precision == "tf32"
    assert tree_config(65, torch.bfloat16).prepare_registers == 128


# GPU: Qwen3.6-27B's GDN layers (Hk 16, Hv 48, Dk = Dv = 128), the default tilings.
REAL = dict(hk=16, hv=48, dk=128, dv=128)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("n", [1, 16, 17, 65, 257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_real_shapes(n, dtype):
    mask = chain_mask(n) if n == 16 else tree_mask(n, seed=n, temperature=8.0)
    q, k, v, g, beta, state = inputs(n, **REAL, seed=n, dtype=dtype)
    want = path_oracle(q, k, v, g, beta, mask, state)
    # float32 values: three TF32 products; bf16 values: one by default (1e-3 of the scale, under
    # bf16's rounding step), three when asked for.
    assert_matches(tree_gated_delta(q, k, v, g, beta, mask, state), want, 1e-4 if dtype == torch.float32 else 2e-3)
    if dtype != torch.float32 and n > 1:
        accurate = replace(tree_config(n, dtype), precision="tf32x3", solve_precision="tf32x3")
        assert_matches(tree_gated_delta(q, k, v, g, beta, mask, state, accurate), want)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("t,length", [(1, 1), (16, 16), (16, 5), (16, 0)])
def test_recurrent_real_shapes(t, length):
    q, k, v, g, beta, state = inputs(t, **REAL, seed=50 + t, dtype=torch.bfloat16)
    s = state.clone()
    got = recurrent_gated_delta(q, k, v, g, beta, s, torch.tensor(length, device=DEVICE))
    o64, s64 = loop_oracle(q, k, v, g, beta, state, length)
    assert_matches(got, o64)
    assert_matches(s, s64)


@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_cuda_graph_replay():
    """Both kernels captured in one graph, replayed on new inputs and a new length."""
    n, t = 65, 16
    mask = tree_mask(n, seed=60, temperature=8.0)
    tree_in = inputs(n, **REAL, seed=61)
    loop_in = inputs(t, **REAL, seed=62)
    length = torch.tensor(3, device=DEVICE)
    state = loop_in[5].clone()

    def run():
        return tree_gated_delta(*tree_in[:5], mask, tree_in[5]), recurrent_gated_delta(*loop_in[:5], state, length)

    run()  # compiles
    state.copy_(loop_in[5])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree_out, loop_out = run()
    fresh_tree, fresh_loop = inputs(n, **REAL, seed=63), inputs(t, **REAL, seed=64)
    for dst, src in zip(tree_in + loop_in, fresh_tree + fresh_loop):
        dst.copy_(src)
    state.copy_(fresh_loop[5])
    length.fill_(12)
    graph.replay()
    assert_matches(tree_out, path_oracle(*fresh_tree[:5], mask, fresh_tree[5]))
    o64, s64 = loop_oracle(*fresh_loop[:5], fresh_loop[5], 12)
    assert_matches(loop_out, o64)
    assert_matches(state, s64)


@pytest.mark.parametrize("root_first", [False, True])
@pytest.mark.parametrize("n,seed", [(1, 30), (5, 31), (40, 32)])
def test_tree_kernel_returns_the_new_values(n, seed, root_first):
    """`u_out` gets the reference's u (what the commit folds), contiguous or a strided view."""
    config = TreeConfig(root_first=root_first)
    q, k, v, g, beta, state = inputs(n, 2, 4, 16, 32, seed)
    visible = tree_mask(n, seed) if n > 1 else torch.ones(1, 1, dtype=torch.bool, device=DEVICE)
    expected = torch.zeros(4, n, 32, device=DEVICE)
    ref.tree_gated_delta(q, k, v, g, beta, visible, state, u_out=expected)
    direct = torch.zeros(4, n, 32, device=DEVICE)
    tree_gated_delta(q, k, v, g, beta, visible, state, config, u_out=direct)
    torch.testing.assert_close(direct, expected, atol=2e-5, rtol=2e-5)
    wide = torch.zeros(4, n + 3, 32, device=DEVICE)  # a view into a larger stash: not contiguous
    tree_gated_delta(q, k, v, g, beta, visible, state, config, u_out=wide[:, :n])
    torch.testing.assert_close(wide[:, :n], expected, atol=2e-5, rtol=2e-5)
    assert torch.count_nonzero(wide[:, n:]) == 0


@pytest.mark.parametrize("length", [0, 1, 3, 6])
def test_fold_equals_the_token_loop_along_the_path(length):
    """Folding a verified tree's stash along one root path (kernel and reference) gives the state
    the token loop reaches along that path, for every layer at once; rows past `length` are
    ignored whatever they hold. A length of 0 (a batch's padding row) leaves the state bit for bit."""
    from ddtree.kernels.gdn_tree import fold_path

    n, hk, hv, dk, dv, layers = 24, 2, 4, 16, 32, 2
    gen = torch.Generator().manual_seed(40 + length)
    logp = torch.log_softmax(5 * torch.randn(7, 30, generator=gen), dim=-1)
    tree = build_tree(logp, torch.tensor(1), n - 1)
    visible = tree.visible.to(DEVICE)
    deepest = int(torch.argmax(tree.depths))
    path = torch.nonzero(tree.visible[deepest]).flatten().tolist()  # root first, depth order
    assert len(path) >= length
    order = torch.tensor(path[:length] + [deepest - 1, 0, 5, 7, 2, 3][: 6 - length] + [n - 1] * 3,
                         device=DEVICE)  # stale rows past length
    states = torch.zeros(layers, hv, dk, dv, device=DEVICE)
    expected = torch.zeros_like(states)
    k_stash = torch.zeros(layers, n, hk, dk, device=DEVICE)
    u_stash = torch.zeros(layers, hv, n, dv, device=DEVICE)
    g_stash = torch.zeros(layers, n, hv, device=DEVICE)
    for layer in range(layers):
        q, k, v, g, beta, state = inputs(n, hk, hv, dk, dv, 50 + layer)
        states[layer] = state
        ref.tree_gated_delta(q, k, v, g, beta, visible, state, u_out=u_stash[layer])
        k_stash[layer], g_stash[layer] = k, ref.path_decay(g, visible)
        loop_state = state.clone()
        rows = torch.tensor(path[:length], device=DEVICE, dtype=torch.long)
        if length:
            ref.recurrent_gated_delta(q[rows], k[rows], v[rows], g[rows], beta[rows], loop_state)
        expected[layer] = loop_state
    length_t = torch.tensor(length, device=DEVICE)
    folded = states.clone()
    ref.fold_path(folded, k_stash, u_stash, g_stash, order, length_t)
    torch.testing.assert_close(folded, expected, atol=2e-5, rtol=2e-5)
    # The default tiling (one tile of these small states) and tiles over both state dimensions.
    for config in (None, FoldConfig(block_k=8, block_v=16, num_warps=1)):
        kernel = states.clone()
        fold_path(kernel, k_stash, u_stash, g_stash, order, length_t, config)
        torch.testing.assert_close(kernel, expected, atol=2e-5, rtol=2e-5)
        if length == 0:
            assert torch.equal(folded, states) and torch.equal(kernel, states)


@pytest.mark.parametrize("root_first", [False, True])
@pytest.mark.parametrize("n,seed", [(1, 40), (5, 41), (40, 42)])
def test_tree_kernel_writes_the_path_decays(n, seed, root_first):
    """`G_out` gets each node's log-decay summed along its root path (`path_decay`), into a
    strided view of a larger stash, as the commit's fold reads it."""
    q, k, v, g, beta, state = inputs(n, 2, 4, 16, 32, seed)
    visible = tree_mask(n, seed) if n > 1 else torch.ones(1, 1, dtype=torch.bool, device=DEVICE)
    stash = torch.zeros(n + 2, 4, device=DEVICE)
    tree_gated_delta(q, k, v, g, beta, visible, state, TreeConfig(root_first=root_first), G_out=stash[:n])
    torch.testing.assert_close(stash[:n], ref.path_decay(g, visible), atol=1e-6, rtol=1e-6)
    assert torch.count_nonzero(stash[n:]) == 0
