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
from ddtree.tree_shape import AR
from tiny_models import make_hybrid_target

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


def prefill(llm: LLM, prompt: list[int]) -> tuple[dict[int, float], torch.Tensor]:
    """The engine's prefill of `prompt` (its real path: a padded graph or eager, as the LLM runs it)
    -> (the first position's top-20 log-probs {token: logprob}, every recurrent layer's state after
    the prompt [layers, Hv, Dk, Dv], float32)."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, logprobs=20)
    steps = llm.engine.generate(prompt, params, AR)
    first = next(steps)
    state = llm.engine.cache.recurrent.state.clone()
    steps.close()
    return dict(first.logprobs[0].top), state


def first_layer_error(tmp_path, monkeypatch, prompt: list[int], use_graphs: bool, in_graphs: bool):
    """A bf16 hybrid's prefill with the chunked rule off and on -> (the first recurrent layer's
    relative state error between the two, every layer's, the chunked rule's calls with it on: the
    token count of each).

    Why the first layer: both runs give it the same inputs (the same embedding and projection, bf16
    and deterministic), so its state differs by the recurrence's rounding alone, as in
    `test_chunked_prefill_equals_the_token_loop_kernel`; a wiring error (scale, layout, the padding
    rows, the state handed back) would be of the state's own size. Deeper layers' inputs carry the
    layers before them, and this random model amplifies bf16 differences layer by layer (on the
    CPU its bf16 token loop's states were 0.6% from float32's at the first recurrent layer and
    23-32% at the last; on the H200 the two paths' greedy tokens parted after 6 and 8 tokens), so
    they are printed, not held to a bound."""
    make_hybrid_target(tmp_path / "t", vocab=512, hidden=128, layers=8, heads=4, kv_heads=2, head_dim=64,
                       linear_key_heads=2, linear_value_heads=4, linear_head_dim=32, max_positions=2048, peak=10.0)
    calls = []
    chunked = gdn_prefill.chunked_gated_delta

    def counted(*args, **kwargs):
        calls.append(args[2].shape[0])
        return chunked(*args, **kwargs)

    monkeypatch.setattr(gdn_prefill, "chunked_gated_delta", counted)
    out = {}
    for on in (False, True):
        monkeypatch.setattr(gdn_prefill, "ENABLED", on)
        monkeypatch.setattr(gdn_prefill, "IN_GRAPHS", on and in_graphs)
        calls.clear()
        llm = LLM(tmp_path / "t", None, device="cuda", dtype="bfloat16", use_graphs=use_graphs, max_model_len=1024)
        out[on] = prefill(llm, prompt)
        if not on:
            assert calls == []
    (lp_off, off), (lp_on, on) = out[False], out[True]
    layers = [relative_error(on[i], off[i]) for i in range(off.shape[0])]
    print("chunked against token loop, relative state error by recurrent layer:", [f"{e:.1e}" for e in layers],
          "top-20 log-probs, token loop:", sorted(lp_off.items(), key=lambda x: -x[1])[:3],
          "chunked:", sorted(lp_on.items(), key=lambda x: -x[1])[:3])
    return layers[0], layers, calls


def test_a_bf16_engine_prefills_through_it_as_the_token_loop_does(tmp_path, monkeypatch):
    """A 300-token prompt, eagerly: the chunked rule runs once per recurrent layer (6 of 8) over the
    whole prompt, and the first recurrent layer's state is the token loop's within bf16 rounding."""
    prompt = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    first, layers, calls = first_layer_error(tmp_path, monkeypatch, prompt, use_graphs=False, in_graphs=False)
    assert len(calls) == 6 and min(calls) >= 300
    assert first < 2e-2, layers


def test_inside_the_padded_prefill_graphs_as_the_token_loop_does(tmp_path, monkeypatch):
    """DDTREE_FLA_PREFILL=graphs: a 300-token prompt's padded prefill graph captures the chunked rule
    (tuned in the graph's warm-up; the padding rows masked), and the first recurrent layer's state
    is the token loop's graph run's within bf16 rounding."""
    prompt = torch.randint(0, 500, (300,), generator=torch.Generator().manual_seed(2)).tolist()
    first, layers, calls = first_layer_error(tmp_path, monkeypatch, prompt, use_graphs=True, in_graphs=True)
    assert calls  # in the capture's warm-up and capture (the replays run no Python)
    assert first < 2e-2, layers
