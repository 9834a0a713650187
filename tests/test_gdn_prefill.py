"""The prefill through flash-linear-attention's chunked rule (`kernels.gdn_prefill`) on the CPU:
its handling of the call (layouts, grouped value heads, the state in and out, padding rows) with a
stand-in that keeps the library's documented contract, and, where fla-core is installed (a CUDA
machine with the `fla` extra), the call checked against the library's own PyTorch reference. The
library's GPU kernel is `test_gpu_gdn_prefill.py`'s."""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from ddtree.kernels import gdn_prefill
from ddtree.models import gated_deltanet as gdn


def contract_stand_in(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """`chunk_gated_delta_rule`'s documented contract through our token loop: q, k [B, T, H, K]
    (q multiplied by `scale`, 1/sqrt(K) when None), v [B, T, Hv, V] (value head j reads key head
    j // (Hv / H)), g log-decay and beta [B, T, Hv], state [N, Hv, K, V] float32 -> (o, final)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = initial_state[0].clone()
    o = gdn.recurrent_gated_delta(q[0].float() * scale, k[0].float(), v[0].float(), g[0], beta[0].float(), state)
    return o[None], state[None]


def fla_reference(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False):
    """The same contract through the library's token-by-token reference (its heads repeated for GVA)."""
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    group = v.shape[2] // q.shape[2]
    return naive.naive_recurrent_gated_delta_rule(q.repeat_interleave(group, 2), k.repeat_interleave(group, 2), v,
                                                  beta, g, scale=scale, initial_state=initial_state,
                                                  output_final_state=output_final_state)


def inputs(t: int, seed: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 32):
    gen = torch.Generator().manual_seed(seed)
    q, k = gdn.normalize_qk(torch.randn(t, hk, dk, generator=gen), torch.randn(t, hk, dk, generator=gen))
    v = torch.randn(t, hv, dv, generator=gen)
    g = F.logsigmoid(torch.randn(t, hv, generator=gen))
    beta = torch.rand(t, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("rule", [contract_stand_in, fla_reference], ids=["contract", "fla_reference"])
@pytest.mark.parametrize("length", [None, 45, "tensor"])
def test_chunked_prefill_equals_the_token_loop(rule, length):
    """Outputs and the state after the first `length` rows equal the token loop's (ours, PyTorch);
    the padding rows past `length` leave the state as it was after them."""
    q, k, v, g, beta, state = inputs(70, 3)
    n = {None: None, 45: 45, "tensor": torch.tensor(45)}[length]
    expected_state = state.clone()
    expected = gdn.recurrent_gated_delta(q, k, v, g, beta, expected_state, n)
    got_state = state.clone()
    got = gdn_prefill.chunked_gated_delta(q, k, v, g, beta, got_state, n, chunk=rule)
    live = 70 if n is None else 45
    torch.testing.assert_close(got[:live], expected[:live], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, expected_state, atol=1e-5, rtol=1e-5)
    assert got.dtype == torch.float32 and got.shape == (70, 4, 32)


@pytest.mark.parametrize("value,enabled,in_graphs", [(None, True, True), ("graphs", True, True), ("1", True, False),
                                                     ("0", False, False), ("yes", None, None)])
def test_the_switch(monkeypatch, value, enabled, in_graphs):
    """DDTREE_FLA_PREFILL: on everywhere by default (where fla-core is installed), 1 outside graph
    captures only, 0 off; anything else is refused when the module loads."""
    if value is None:
        monkeypatch.delenv("DDTREE_FLA_PREFILL", raising=False)
    else:
        monkeypatch.setenv("DDTREE_FLA_PREFILL", value)
    try:
        if enabled is None:
            with pytest.raises(ValueError, match="DDTREE_FLA_PREFILL must be 0, 1 or graphs"):
                importlib.reload(gdn_prefill)
        else:
            importlib.reload(gdn_prefill)
            assert (gdn_prefill.ENABLED, gdn_prefill.IN_GRAPHS) == (enabled, in_graphs)
    finally:
        monkeypatch.undo()
        importlib.reload(gdn_prefill)


def test_the_prefill_runs_only_where_it_is_asked_for_and_fits(monkeypatch):
    """Off with DDTREE_FLA_PREFILL=0; on, only on CUDA, for 2-byte values, long runs and a float32
    state (a CPU tensor is refused whatever is asked)."""
    q, k, v, g, beta, state = inputs(70, 4)
    monkeypatch.setattr(gdn_prefill, "ENABLED", False)
    assert not gdn_prefill.usable(v.bfloat16(), state)
    monkeypatch.setattr(gdn_prefill, "ENABLED", True)
    assert not gdn_prefill.usable(v.bfloat16(), state)  # a CPU tensor
    if torch.cuda.is_available():
        cuda_state = state.cuda()
        assert not gdn_prefill.usable(v.cuda(), cuda_state)  # float32 values keep the exact token loop
        assert not gdn_prefill.usable(v[:10].cuda().bfloat16(), cuda_state)  # shorter than a chunk
        assert gdn_prefill.usable(v.cuda().bfloat16(), cuda_state) == (gdn_prefill.chunk_rule() is not None)


def test_a_failing_library_turns_itself_off_and_leaves_the_state(monkeypatch, caplog):
    """Where the library's kernels fail (a GPU or shape it does not handle), the call gives None
    with the state untouched, says so once, and the chunked rule is off from then on."""
    q, k, v, g, beta, state = inputs(70, 5)
    before = state.clone()

    def broken(*args, **kwargs):
        raise RuntimeError("PTX .version 8.7 does not support .target sm_61\nmore detail")

    monkeypatch.setattr(gdn_prefill, "ENABLED", True)
    with caplog.at_level("WARNING", logger="ddtree"):
        assert gdn_prefill.chunked_or_none(q, k, v, g, beta, state, chunk=broken) is None
    assert torch.equal(state, before) and gdn_prefill.ENABLED is False
    assert "token-loop kernel from now on" in caplog.text and "sm_61" in caplog.text and "more detail" not in caplog.text
    monkeypatch.setattr(gdn_prefill, "ENABLED", True)
    got = gdn_prefill.chunked_or_none(q, k, v, g, beta, state, chunk=contract_stand_in)
    assert got is not None and gdn_prefill.ENABLED is True  # a working rule is just called
