"""On a CUDA GPU with fla-core installed: the prefill through flash-linear-attention's chunked rule
(`kernels.gdn_prefill`, DDTREE_FLA_PREFILL=1) against the token-loop kernel it replaces, at
Qwen3.6-27B's Gated DeltaNet heads and through a bf16 hybrid engine."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree.config import SamplingParams
from ddtree.kernels import gdn_prefill
from ddtree.llm import LLM
from ddtree.models import gated_deltanet as gdn
from tiny_models import make_drafter, make_hybrid_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or gdn_prefill.chunk_rule() is None,
                                reason="needs a CUDA GPU and fla-core")


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("t,length", [(4133, 4100), (512, None)])
def test_chunked_prefill_equals_the_token_loop_kernel(t, length):
    """Outputs over the live rows and the state after them, within bf16 rounding of the token loop
    (which takes float32 q and k; the chunked rule takes them in bf16)."""
    from ddtree.kernels import gdn_tree

    gen = torch.Generator(device="cuda").manual_seed(0)
    hk, hv, d = 16, 48, 128
    q, k = gdn.normalize_qk(torch.randn(t, hk, d, device="cuda", generator=gen),
                            torch.randn(t, hk, d, device="cuda", generator=gen))
    v = torch.randn(t, hv, d, device="cuda", generator=gen).bfloat16()
    g = F.logsigmoid(torch.randn(t, hv, device="cuda", generator=gen) + 3)  # decays near 1, as trained models have
    beta = torch.rand(t, hv, device="cuda", generator=gen)
    state = torch.randn(hv, d, d, device="cuda", generator=gen) * 0.1
    n = None if length is None else torch.tensor(length, device="cuda")
    loop_state, chunk_state = state.clone(), state.clone()
    expected = gdn_tree.recurrent_gated_delta(q, k, v, g, beta, loop_state, n)
    got = gdn_prefill.chunked_gated_delta(q, k, v, g, beta, chunk_state, n)
    live = t if length is None else length
    assert relative_error(got[:live], expected[:live]) < 2e-2
    assert relative_error(chunk_state, loop_state) < 2e-2


def test_a_bf16_engine_prefills_through_it_and_decodes_as_with_the_token_loop(tmp_path, monkeypatch):
    """A 300-token prompt (eager prefill) with the chunked rule on: it runs, once per recurrent
    layer, and the greedy output equals the token loop's (a peaked model: no near-ties)."""
    make_hybrid_target(tmp_path / "t", vocab=512, hidden=128, layers=8, heads=4, kv_heads=2, head_dim=64,
                       linear_key_heads=2, linear_value_heads=4, linear_head_dim=32, max_positions=2048, peak=10.0)
    make_drafter(tmp_path / "d", tmp_path / "t", block_size=16)
    prompt = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    calls = []
    chunked = gdn_prefill.chunked_gated_delta

    def counted(*args, **kwargs):
        calls.append(args[2].shape[0])
        return chunked(*args, **kwargs)

    monkeypatch.setattr(gdn_prefill, "chunked_gated_delta", counted)
    for on in (False, True):
        monkeypatch.setattr(gdn_prefill, "ENABLED", on)
        llm = LLM(tmp_path / "t", tmp_path / "d", device="cuda", dtype="bfloat16", use_graphs=False, max_model_len=1024)
        calls.clear()
        outputs[on] = {budget: llm.generate([prompt], params, tree_budget=budget)[0].token_ids
                       for budget in ("ar", 16)}
        # 6 recurrent layers of 8, once per prefill (of the prompt, or all but its last token)
        assert (len(calls) == 6 * 2 and min(calls) >= 299) if on else calls == []
    assert outputs[True] == outputs[False]


def test_inside_the_padded_prefill_graphs_it_decodes_as_the_token_loop(tmp_path, monkeypatch):
    """DDTREE_FLA_PREFILL=graphs: a 300-token prompt's padded prefill graph captures the chunked rule
    (tuned in the graph's warm-up), and the greedy output equals the token loop's graph run."""
    make_hybrid_target(tmp_path / "t", vocab=512, hidden=128, layers=8, heads=4, kv_heads=2, head_dim=64,
                       linear_key_heads=2, linear_value_heads=4, linear_head_dim=32, max_positions=2048, peak=10.0)
    make_drafter(tmp_path / "d", tmp_path / "t", block_size=16)
    prompt = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs, calls = {}, []
    chunked = gdn_prefill.chunked_gated_delta
    monkeypatch.setattr(gdn_prefill, "chunked_gated_delta", lambda *a, **k: calls.append(1) or chunked(*a, **k))
    for on in (False, True):
        monkeypatch.setattr(gdn_prefill, "ENABLED", on)
        monkeypatch.setattr(gdn_prefill, "IN_GRAPHS", on)
        llm = LLM(tmp_path / "t", tmp_path / "d", device="cuda", dtype="bfloat16", use_graphs=True, max_model_len=1024)
        calls.clear()
        outputs[on] = [llm.generate([prompt], params, tree_budget=budget)[0].token_ids for budget in ("ar", 16)]
        assert bool(calls) == on
    assert outputs[True] == outputs[False]
