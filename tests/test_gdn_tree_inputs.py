"""`hybrid.gdn_tree_inputs`, the verify's Gated DeltaNet glue (conv inputs gathered per node, conv,
SiLU, q/k norms, gates, the commit's stash), equals the materialised form it replaces: the conv
inputs [N, K, C] as [window; mixed] indexed by `conv_ancestors`, the conv summed over K, and
G = visible.float() @ g. Eagerly bit for bit in float32 and bf16, on branching trees, a chain and
one node; `path_decay`'s traced form (a masked sum) within float32 rounding of the product; and
compiled by Inductor on the CPU, one dynamic graph for two tree sizes, equal to eager.
"""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from ddtree.models import gated_deltanet as gdn
from ddtree.models import hybrid
from ddtree.tree import build_chain, build_tree

HK, DK, HV, DV, K = 2, 16, 4, 16, 4
C = 2 * HK * DK + HV * DV


def branching_tree(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    tree = build_tree(torch.log_softmax(3 * torch.randn(7, 50, generator=gen), -1), torch.tensor(5), n - 1)
    assert int(tree.depths.max()) >= K and int((tree.parents == 0).sum()) >= 2  # past the window, and branching
    return tree


def layer_inputs(tree, dtype, seed: int):
    """A layer's verify inputs on `tree`: window, mixed (a slice of a fused projection, as in the
    model), ancestors, visible, a, b and the weights."""
    gen = torch.Generator().manual_seed(seed)
    n = tree.parents.shape[0]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    mixed, b, a = randn(n, C + 2 * HV).split([C, HV, HV], dim=-1)
    ancestors = hybrid.conv_ancestors(tree.parents, tree.depths, K)
    return dict(window=randn(K - 1, C), mixed=mixed, ancestors=ancestors, visible=tree.visible, a=a, b=b,
                conv_weight=randn(C, K), A_log=randn(HV), dt_bias=randn(HV))


def run_tree_inputs(fn, x, dtype):
    """-> (q, k, v, g, beta, G, stashed mixed), the stash read back from the scratch it went to."""
    n = x["mixed"].shape[0]
    mixed_out, k_out, G_out = torch.zeros(n, C, dtype=dtype), torch.zeros(n, HK, DK), torch.zeros(n, HV)
    q, v, g, beta = fn(x["window"], x["mixed"], x["ancestors"], x["visible"], x["a"], x["b"], x["conv_weight"],
                       x["A_log"], x["dt_bias"], mixed_out, k_out, G_out, HK, DK, HV, DV)
    return q, k_out, v, g, beta, G_out, mixed_out


def materialised(x):
    """The form `gdn_tree_inputs` replaces, written out: conv_in [N, K, C], summed over K."""
    n = x["mixed"].shape[0]
    conv_in = torch.cat([x["window"], x["mixed"]], dim=0)[x["ancestors"]]
    conv = (conv_in.float() * x["conv_weight"].float().t()[None]).sum(1).to(conv_in.dtype)
    q, k, v = F.silu(conv).split([HK * DK, HK * DK, HV * DV], dim=-1)
    q, k = gdn.normalize_qk(q.reshape(n, HK, DK), k.reshape(n, HK, DK))
    g = -x["A_log"].float().exp() * F.softplus(x["a"].float() + x["dt_bias"])
    G = x["visible"].float() @ g
    return q, k, v.reshape(n, HV, DV), g, x["b"].sigmoid().float(), G, x["mixed"]


def trees():
    return [branching_tree(40, 0), branching_tree(57, 1), build_chain(torch.arange(10, 25), torch.tensor(3)),
            build_chain(torch.arange(0), torch.tensor(3))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_inputs_equal_the_materialised_conv_inputs(dtype):
    for seed, tree in enumerate(trees()):
        x = layer_inputs(tree, dtype, seed)
        names = ("q", "k", "v", "g", "beta", "G", "mixed")
        for name, got, want in zip(names, run_tree_inputs(hybrid.gdn_tree_inputs, x, dtype), materialised(x)):
            assert got.dtype == want.dtype and torch.equal(got, want), (name, tree.parents.shape[0], dtype)


def test_sequence_inputs_equal_the_summed_conv():
    """`gdn_inputs` (the sequence form) sums its taps in the order a sum over K does."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        padded = torch.randn(K - 1 + 30, C, generator=gen).to(dtype)
        conv_in = padded.unfold(0, K, 1).transpose(1, 2)
        a, b = torch.randn(30, HV, generator=gen).to(dtype), torch.randn(30, HV, generator=gen).to(dtype)
        weight, A_log, dt_bias = (torch.randn(C, K, generator=gen).to(dtype), torch.randn(HV).to(dtype),
                                  torch.randn(HV).to(dtype))
        q, k, v, _, _ = hybrid.gdn_inputs(conv_in, a, b, weight, A_log, dt_bias, HK, DK, HV, DV)
        conv = F.silu((conv_in.float() * weight.float().t()[None]).sum(1).to(dtype))
        q_ref, k_ref, v_ref = conv.split([HK * DK, HK * DK, HV * DV], dim=-1)
        q_ref, k_ref = gdn.normalize_qk(q_ref.reshape(30, HK, DK), k_ref.reshape(30, HK, DK))
        assert torch.equal(q, q_ref) and torch.equal(k, k_ref) and torch.equal(v.reshape(30, -1), v_ref)


def test_traced_path_decay_is_the_product_within_rounding(monkeypatch):
    """What torch.compile traces (the masked sum) against the eager product, on a 1025-node tree."""
    tree = build_tree(torch.log_softmax(torch.randn(15, 100, generator=torch.Generator().manual_seed(4)), -1),
                      torch.tensor(5), 1024)
    g = -torch.rand(tree.parents.shape[0], 48, generator=torch.Generator().manual_seed(5)) * 3
    product = gdn.path_decay(g, tree.visible)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    masked = gdn.path_decay(g, tree.visible)
    torch.testing.assert_close(masked, product, atol=1e-5, rtol=1e-6)


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                    reason="Inductor's CPU backend needs a C++ compiler")
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inside Inductor
def test_compiled_tree_inputs_equal_eager():
    """Inductor (CPU), dynamic shapes: one graph serves two tree sizes, with the eager values
    (float32; the compiled kernels sum in other orders)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(hybrid.gdn_tree_inputs, dynamic=True, fullgraph=True)
    try:
        for seed, n in enumerate((23, 40)):
            x = layer_inputs(branching_tree(n, seed), torch.float32, seed)
            for got, want in zip(run_tree_inputs(compiled, x, torch.float32),
                                 run_tree_inputs(hybrid.gdn_tree_inputs, x, torch.float32)):
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_conv_kernel_equals_the_materialised_conv(dtype):
    """`kernels.tree_conv` (on the CPU in Triton's interpreter) convolves each node over its
    ancestors as the materialised form does, SiLU'd, and stashes the conv inputs; its sums are
    float32 multiply-adds in the same order, so within one rounding of the inputs' dtype."""
    pytest.importorskip("triton")
    from ddtree.kernels import tree_conv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed, tree in enumerate(trees()):
        x = {name: t.to(device) for name, t in layer_inputs(tree, dtype, seed).items()}
        n = x["mixed"].shape[0]
        assert tree_conv.supported(x["window"], x["mixed"], x["conv_weight"])
        stash = torch.zeros(n, C, dtype=dtype, device=device)
        got = tree_conv.tree_conv_silu(x["window"], x["mixed"], x["ancestors"], x["conv_weight"], stash)
        conv_in = torch.cat([x["window"], x["mixed"]], dim=0)[x["ancestors"]]
        want = F.silu((conv_in.float() * x["conv_weight"].float().t()[None]).sum(1).to(dtype))
        tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2 ** -6)  # two roundings
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, **tol)
        assert torch.equal(stash, x["mixed"])


@pytest.mark.parametrize("length", [0, 1, 2, 3, 5])
def test_commit_windows_kernel_keeps_the_last_inputs(length):
    """`kernels.tree_conv.commit_windows` (on the CPU in Triton's interpreter): every layer's window
    becomes the last K - 1 rows of [window; the stash's rows along the path's first `length`
    nodes], exactly (rows are moved, not computed), in a stash wider than its channels, with stale
    path entries past `length`; a length of 0 leaves the windows bit for bit."""
    pytest.importorskip("triton")
    from ddtree.kernels import tree_conv

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(70 + length)
    layers, nodes, channels = 3, 12, 1100  # two channel blocks, the second partial
    windows = torch.randn(layers, K - 1, channels, generator=gen).bfloat16().to(device)
    stash = torch.randn(layers, nodes, channels + 5, generator=gen).bfloat16().to(device)[:, :, :channels]
    order = torch.tensor([0, 4, 9, 10, 11, 3, 2], device=device)
    padded = torch.cat([windows, stash[:, order[:length]]], dim=1)
    want = padded[:, padded.shape[1] - (K - 1):]
    got = windows.clone()
    assert tree_conv.commit_windows_supported(got, stash)
    tree_conv.commit_windows(got, stash, order, torch.tensor(length, device=device))
    assert torch.equal(got, want)
    if length == 0:
        assert torch.equal(got, windows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_kernel_equals_gdn_tree_inputs(dtype):
    """`kernels.tree_gdn_inputs` (on the CPU in Triton's interpreter) gives what
    `gdn_tree_inputs` gives eagerly: the conv (each node over its ancestors, then the window), SiLU,
    normalised q and k, v, g and beta, and the stash of the conv inputs (exactly). In float32 to
    float32 rounding (a head's sum of squares and exp/log may add in another order); in bf16
    within one rounding step of the conv and of beta."""
    pytest.importorskip("triton")
    from ddtree.kernels import tree_gdn_inputs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for seed, tree in enumerate(trees()):
        x = {name: t.to(device) for name, t in layer_inputs(tree, dtype, seed).items()}
        n = x["mixed"].shape[0]
        assert tree_gdn_inputs.supported(x["window"], x["mixed"], x["conv_weight"], DK, DV)
        stash, k_out = torch.zeros(n, C, dtype=dtype, device=device), torch.zeros(n, HK, DK, device=device)
        q, v, g, beta = tree_gdn_inputs.tree_gdn_inputs(x["window"], x["mixed"], x["ancestors"], x["conv_weight"],
                                                        x["a"], x["b"], x["A_log"], x["dt_bias"], HK, DK, HV, DV,
                                                        stash, k_out)
        want_q, want_k, want_v, want_g, want_beta, _, _ = materialised(x)
        assert q.dtype == k_out.dtype == g.dtype == beta.dtype == torch.float32 and v.dtype == dtype
        assert torch.equal(stash, x["mixed"])
        torch.testing.assert_close(g, want_g, atol=1e-6, rtol=1e-5)
        if dtype == torch.float32:
            tol = dict(atol=1e-6, rtol=1e-5)
        else:  # bf16 roundings (the conv's, beta's) can land one step apart; q and k are normalised after
            tol = dict(atol=2e-2, rtol=2 ** -6)
        torch.testing.assert_close(beta, want_beta, **tol)
        torch.testing.assert_close(v, want_v, **tol)
        torch.testing.assert_close(q, want_q, **tol)
        torch.testing.assert_close(k_out, want_k, **tol)
