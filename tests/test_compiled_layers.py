"""The compiled layer functions (`fused.compiled_ops`, used on CUDA) serve both models, both
dtypes, prefill, one-token and block forwards without running into dynamo's recompile limit
(which `fullgraph=True` makes an error), and give the eager functions' tokens.

On the CPU dynamo traces with its "eager" backend here (no kernels are generated): what is
checked is the tracing and the guards, which are the same on every device."""
from __future__ import annotations

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.models import fused
from tiny_models import make_drafter, make_target


@pytest.fixture()
def eager_backend_compile(monkeypatch):
    real = torch.compile

    def compile_eager(fn, **kwargs):
        return real(fn, backend="eager", **kwargs)

    monkeypatch.setattr(torch, "compile", compile_eager)
    monkeypatch.setattr(fused, "_COMPILED", None)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def assert_compiled_equals_eager(root, compiled_ops, eager_ops):
    """The pair under `root` decodes the same tokens with compiled and eager layer functions, in
    both dtypes, at ar, chain and a tree (prefill, one-token and tree forwards, commits)."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = list(range(5, 30))
    for dtype in ("float32", "bfloat16"):
        compiled = LLM(root / "t", root / "d", device="cpu", dtype=dtype, max_model_len=128, compile_layers=True)
        eager = LLM(root / "t", root / "d", device="cpu", dtype=dtype, max_model_len=128)
        assert compiled.engine.target.ops is compiled_ops() and eager.engine.target.ops is eager_ops
        for budget in ("ar", "chain", 4):
            assert compiled.generate(prompt, params, budget).token_ids == \
                eager.generate(prompt, params, budget).token_ids, (dtype, budget)


def test_one_compiled_set_serves_every_call(tmp_path, eager_backend_compile):
    make_target(tmp_path / "t", "qwen3", vocab=512, hidden=64, layers=3)
    make_drafter(tmp_path / "d", tmp_path / "t", block_size=8)
    assert_compiled_equals_eager(tmp_path, lambda: fused._COMPILED, fused.EAGER)


def test_hybrid_compiled_glue_serves_every_call(tmp_path, eager_backend_compile, monkeypatch):
    """The hybrid target's compiled glue (`hybrid.HybridOps`): prefill, `ar` steps, tree verifies
    and commits of every layer kind, in both dtypes, within the recompile limit, same tokens."""
    from ddtree.models import hybrid
    from tiny_models import make_hybrid_target

    monkeypatch.setattr(hybrid, "_HYBRID_COMPILED", None)
    make_hybrid_target(tmp_path / "t", layers=4)
    make_drafter(tmp_path / "d", tmp_path / "t", block_size=8)
    assert_compiled_equals_eager(tmp_path, lambda: hybrid._HYBRID_COMPILED, hybrid.HYBRID_EAGER)
