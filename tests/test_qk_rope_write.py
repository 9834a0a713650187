"""`kernels.qk_rope_write` equals the layer's compiled functions run eagerly: the q/k heads' RMSNorm
(`fused.rms_norm`, or `hybrid.zero_centred_rms_norm`), `fused.rotate` over all or part of the head
dim, q written out, k and v stored at their slots and no other slot touched. On the CPU through
Triton's interpreter; on a GPU also at Qwen3-8B's heads in bf16."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # without a GPU, conftest has put Triton in interpreter mode
from ddtree.kernels.qk_rope_write import qk_rope_write  # noqa: E402
from ddtree.models.fused import rms_norm, rotate  # noqa: E402
from ddtree.models.hybrid import zero_centred_rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # n, Hq, Hkv, D, rotary dims, q/k norm, zero-centred norm, gated q (a gate after each query head)
    (1, 4, 2, 16, 16, True, False, False),
    (7, 4, 2, 32, 32, True, False, False),
    (5, 6, 2, 32, 16, True, True, True),  # Qwen3.6's gated attention: partial rotary, (1 + w) norm
    (3, 4, 2, 16, 16, False, False, False),  # no q/k norm (Llama)
    (9, 3, 1, 64, 32, True, False, False),  # Hq not a multiple of the heads a program takes
]


def _inputs(n, hq, hkv, d, rotary, gated, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    width = (2 if gated else 1) * hq * d
    qkv = torch.randn(n, width + 2 * hkv * d, generator=gen).to(DEVICE, dtype)
    q, k, v = qkv.split([width, hkv * d, hkv * d], dim=-1)
    q = q.view(n, hq, 2 * d)[..., :d] if gated else q.view(n, hq, d)
    angles = torch.rand(n, rotary // 2, generator=gen) * 6.0
    cos_sin = torch.cat([angles, angles], dim=-1)
    norms = (torch.randn(2, d, generator=gen) * 0.2 + (0.0 if gated else 1.0)).to(DEVICE, dtype)
    return (q, k.view(n, hkv, d), v.view(n, hkv, d), norms, cos_sin.cos().to(DEVICE, dtype),
            cos_sin.sin().to(DEVICE, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("n,hq,hkv,d,rotary,norm,centred,gated", CASES)
def test_equals_the_eager_functions(n, hq, hkv, d, rotary, norm, centred, gated, dtype):
    q, k, v, norms, cos, sin = _inputs(n, hq, hkv, d, rotary, gated, dtype, seed=n + d)
    slots_total = 3 * n + 4
    gen = torch.Generator().manual_seed(7 * n)
    slots = torch.randperm(slots_total, generator=gen)[:n].to(DEVICE)
    before = torch.randn(2, slots_total, hkv, d, generator=gen).to(DEVICE, dtype)
    cache = before.clone()
    eps = 1e-6
    q_norm, k_norm = (norms[0], norms[1]) if norm else (None, None)
    out = qk_rope_write(q, k, v, q_norm, k_norm, cos, sin, eps, slots, cache[0], cache[1], centred=centred)

    def reference(x, w):
        if w is not None:
            x = zero_centred_rms_norm(x.float(), w.float(), eps) if centred else rms_norm(x.float(), w.float(), eps)
            x = x.to(dtype).float()  # the norm's output rounded as the layer's is
        return rotate(x, cos.float(), sin.float())

    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert out.shape == (n, hq, d) and out.is_contiguous()
    torch.testing.assert_close(out.float(), reference(q, q_norm), **tol)
    torch.testing.assert_close(cache[0, slots].float(), reference(k, k_norm), **tol)
    assert torch.equal(cache[1, slots], v)
    untouched = torch.ones(slots_total, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(cache[:, untouched], before[:, untouched])



@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm", "no_qk_norm"])
def test_row_scale_is_the_input_norm_before_everything(norm):
    """scale_rows h: q, k and v first multiplied by each token's 1 / sqrt(mean(h^2) + eps), the scale
    of an input norm whose weight is folded into the projection."""
    n, hq, hkv, d = 6, 4, 2, 32
    q, k, v, norms, cos, sin = _inputs(n, hq, hkv, d, d, False, torch.float32, seed=5)
    h = (4 * torch.randn(n, 80, generator=torch.Generator().manual_seed(9))).to(DEVICE)
    eps = 1e-6
    r = torch.rsqrt(h.pow(2).mean(-1) + eps)[:, None, None]
    cache = torch.zeros(2, n, hkv, d, device=DEVICE)
    slots = torch.arange(n, device=DEVICE)
    q_norm, k_norm = (norms[0], norms[1]) if norm else (None, None)
    out = qk_rope_write(q, k, v, q_norm, k_norm, cos, sin, eps, slots, cache[0], cache[1], scale_rows=h)

    def reference(x, w):
        x = x * r
        return rotate(rms_norm(x, w, eps) if w is not None else x, cos, sin)

    torch.testing.assert_close(out, reference(q, q_norm), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[0], reference(k, k_norm), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache[1], v * r, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="scale_rows"):
        qk_rope_write(q, k, v, q_norm, k_norm, cos, sin, eps, slots, cache[0], cache[1], scale_rows=h[:3])

def test_refuses_an_odd_or_too_wide_rotation():
    q, k, v, norms, cos, sin = _inputs(2, 4, 2, 16, 16, False, torch.float32, seed=1)
    cache = torch.zeros(2, 4, 2, 16, device=DEVICE)
    slots = torch.tensor([0, 1], device=DEVICE)
    wide = torch.cat([cos, cos], dim=-1)
    with pytest.raises(ValueError, match="rotary|R even"):
        qk_rope_write(q, k, v, norms[0], norms[1], wide, wide, 1e-6, slots, cache[0], cache[1])
    assert not cache.any()


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
def test_qwen3_8b_heads_on_the_device():
    q, k, v, norms, cos, sin = _inputs(65, 32, 8, 128, 128, False, torch.bfloat16, seed=3)
    cache = torch.zeros(2, 200, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    slots = torch.arange(100, 165, device=DEVICE)
    out = qk_rope_write(q, k, v, norms[0], norms[1], cos, sin, 1e-6, slots, cache[0], cache[1])
    ref_q = rotate(rms_norm(q, norms[0], 1e-6), cos, sin)
    ref_k = rotate(rms_norm(k, norms[1], 1e-6), cos, sin)
    torch.testing.assert_close(out, ref_q, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(cache[0, slots], ref_k, rtol=2e-2, atol=2e-2)
    assert torch.equal(cache[1, slots], v)


@pytest.mark.parametrize("kind", ["qwen3", "hybrid"])
def test_a_models_forward_through_the_kernel_equals_its_compiled_functions(kind, tmp_path, monkeypatch):
    """A dense target's and a hybrid's layers with the kernel (forced on here: on a GPU it is the
    default) equal their layers without it: a prefill, then a tree step over the cache."""
    pytest.importorskip("transformers")
    from ddtree.kernels import qk_rope_write as kernel
    from ddtree.models.layers import AttentionMeta
    from ddtree.models.loading import load_target
    from tiny_models import make_hybrid_target, make_target

    if kind == "hybrid":
        pytest.importorskip("transformers.models.qwen3_5")
        make_hybrid_target(tmp_path)
    else:
        make_target(tmp_path)
    model = load_target(tmp_path, DEVICE, torch.float32, 128)
    tokens = torch.randint(0, model.config.vocab_size, (24,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    visible = torch.ones(5, 5, dtype=torch.bool).tril()
    visible[3, 1:3] = False  # a branch: node 3 sees the root only

    def run(through_kernel: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(kernel, "supported", lambda x, cache_k: through_kernel)
        cache = model.new_cache(128, DEVICE, torch.float32)
        slots = torch.arange(24, device=DEVICE)
        with torch.no_grad():
            first, _ = model(tokens[:19], slots[:19], AttentionMeta(slots[:19], 19, None, causal=True), cache)
            step = AttentionMeta(slots[19:], 24, prefix_len=torch.tensor(19, device=DEVICE),
                                 block_mask=visible.to(DEVICE))
            second, _ = model(tokens[19:], torch.tensor([19, 20, 21, 20, 21], device=DEVICE), step, cache)
        return [first, second]

    for ours, ref in zip(run(True), run(False)):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
