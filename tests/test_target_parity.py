"""Our target model against transformers' Qwen3ForCausalLM / LlamaForCausalLM (float32, CPU).

Random tiny checkpoints are written to disk and read back by both sides. Besides a plain prefill,
the cache path is checked the way the engine uses it: a prefill in two chunks, then tree-shaped
steps (ancestor-only mask, positions n + depth) each followed by a compaction that commits one
root-to-node path; every node's logits must equal transformers' logits for the committed
sequence followed by that node's path.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ddtree import LLM, SamplingParams
from ddtree.models.layers import AttentionMeta
from ddtree.models.loading import load_target
from tiny_models import make_drafter, make_target

transformers = pytest.importorskip("transformers")

REL_TOL = 1e-4
MAX_POS = 256
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

# YaRN (static: the same scaled frequencies at every position) at a pretrained length of 64, where
# its ramp between kept and interpolated frequencies falls inside a 16-dim head's 8.
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
YARN_MSCALE_ROPE = {**YARN_ROPE, "factor": 8.0, "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2}

CASES = {
    "qwen3-gqa-single-file": dict(arch="qwen3", kv_heads=2),
    "qwen3-sharded-tied-mqa": dict(arch="qwen3", kv_heads=1, shard=True, tie=True),
    "qwen3-wide-head-dim": dict(arch="qwen3", heads=4, kv_heads=2, head_dim=32),
    "llama-gqa-llama3-rope": dict(arch="llama", kv_heads=2, rope_scaling=LLAMA3_ROPE),
    "llama-sharded-tied-mha": dict(arch="llama", heads=4, kv_heads=4, shard=True, tie=True),
    "llama-legacy-rope-fields": dict(arch="llama", kv_heads=2, rope_scaling=LLAMA3_ROPE, legacy_rope=True),
    "qwen3-yarn-rope": dict(arch="qwen3", kv_heads=2, rope_scaling=YARN_ROPE),
    "llama-yarn-rope-mscale-legacy": dict(arch="llama", kv_heads=2, rope_scaling=YARN_MSCALE_ROPE, legacy_rope=True),
}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def write_legacy_rope(path: Path) -> None:
    """Rewrite config.json the way transformers 4.x checkpoints spell rope: rope_theta + rope_scaling."""
    cfg = json.loads((path / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    kw = dict(CASES[request.param])
    legacy = kw.pop("legacy_rope", False)
    path = tmp_path_factory.mktemp(request.param)
    make_target(path, **kw)
    if legacy:
        write_legacy_rope(path)
    if kw.get("shard"):
        assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("model-*.safetensors"))) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_target(path, "cpu", torch.float32, MAX_POS)
    return path, hf, ours


@torch.no_grad()
def hf_logits(hf, seq: list[int]) -> torch.Tensor:
    """[len(seq), V] logits of transformers' model over the whole sequence, no cache."""
    return hf(torch.tensor([seq])).logits[0]


class OurRunner:
    """Drives our target over a static cache as the engine does: chunks and tree steps."""

    def __init__(self, model, slots: int = MAX_POS):
        self.model = model
        self.cache = model.new_cache(slots, "cpu", next(model.parameters()).dtype)
        gen = torch.Generator().manual_seed(123)
        self.cache.k.normal_(generator=gen)  # stale entries past the committed length must be ignored
        self.cache.v.normal_(generator=gen)
        self.n = 0

    @torch.no_grad()
    def forward(self, tokens: list[int], depths: list[int], visible: torch.Tensor) -> torch.Tensor:
        """New tokens at positions n + depth, in slots n.., seeing the committed context and
        `visible` [N, N] among themselves. Returns logits [N, V]."""
        m = len(tokens)
        slots = self.n + torch.arange(m)
        if self.n == 0 and torch.equal(visible, torch.ones(m, m, dtype=torch.bool).tril()):
            meta = AttentionMeta(slots, m, None, causal=True)
        else:
            mask = torch.cat([torch.ones(m, self.n, dtype=torch.bool), visible], dim=1)
            meta = AttentionMeta(slots, self.n + m, mask)
        logits, _ = self.model(torch.tensor(tokens), self.n + torch.tensor(depths), meta, self.cache)
        return logits

    def chunk(self, tokens: list[int]) -> torch.Tensor:
        m = len(tokens)
        logits = self.forward(tokens, list(range(m)), torch.ones(m, m, dtype=torch.bool).tril())
        self.n += m
        return logits

    def commit(self, path_nodes: list[int], tree_size: int) -> None:
        """Keep the tree nodes `path_nodes` (root first) as the next committed entries."""
        rest = [i for i in range(tree_size) if i not in path_nodes]
        self.cache.compact(self.n, torch.tensor(path_nodes + rest))
        self.n += len(path_nodes)


def random_tree(gen: torch.Generator, size: int, vocab: int) -> tuple[list[int], list[int], list[int]]:
    """tokens, parents (root: -1), depths of a random tree whose parents come before children."""
    tokens = torch.randint(0, vocab, (size,), generator=gen).tolist()
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, size)]
    depths = [0] * size
    for i in range(1, size):
        depths[i] = depths[parents[i]] + 1
    return tokens, parents, depths


def path_to(node: int, parents: list[int]) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_prefill_logits_match(case):
    _, hf, ours = case
    gen = torch.Generator().manual_seed(1)
    for length in (1, 7, 40):
        seq = torch.randint(0, hf.config.vocab_size, (length,), generator=gen).tolist()
        ref = hf_logits(hf, seq)
        runner = OurRunner(ours)
        assert rel_err(runner.chunk(seq), ref) < REL_TOL, f"prompt of {length} tokens"


def test_chunked_prefill_and_tree_steps_over_the_cache(case):
    _, hf, ours = case
    vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(2)
    seq = torch.randint(0, vocab, (30,), generator=gen).tolist()
    runner = OurRunner(ours)
    full = hf_logits(hf, seq)
    assert rel_err(runner.chunk(seq[:17]), full[:17]) < REL_TOL, "first chunk (empty cache)"
    assert rel_err(runner.chunk(seq[17:]), full[17:]) < REL_TOL, "second chunk (over the cache)"
    committed = list(seq)

    for step, size in enumerate((9, 12, 5, 16)):
        tokens, parents, depths = random_tree(gen, size, vocab)
        visible = torch.zeros(size, size, dtype=torch.bool)
        for i in range(size):
            visible[i, path_to(i, parents)] = True
        logits = runner.forward(tokens, depths, visible)
        for i in range(size):
            path_tokens = [tokens[j] for j in path_to(i, parents)]
            ref = hf_logits(hf, committed + path_tokens)[-1]
            assert rel_err(logits[i], ref) < REL_TOL, f"tree step {step}, node {i} (depth {depths[i]})"
        deepest = max(range(size), key=lambda i: depths[i])
        keep = path_to(deepest, parents)
        runner.commit(keep, size)
        committed += [tokens[j] for j in keep]
        assert runner.n == len(committed)


def test_eos_and_tie_settings_read(case):
    path, hf, ours = case
    cfg = ours.config
    assert cfg.tie_word_embeddings == bool(hf.config.tie_word_embeddings)
    if cfg.tie_word_embeddings:
        assert ours.lm_head.weight.data_ptr() == ours.embed_tokens.weight.data_ptr()
    assert cfg.eos_token_ids == [1]


# -- reduced precision ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp32_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp32")
    make_target(path, "qwen3", kv_heads=2)
    return path


@pytest.mark.parametrize("saved_dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision_checkpoint_loads_exactly(tmp_path, fp32_target, saved_dtype):
    """A bf16 / fp16 checkpoint read into float32 equals transformers reading it into float32."""
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(fp32_target, dtype=saved_dtype)
    hf16.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16" if saved_dtype == torch.bfloat16 else "F16"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_target(tmp_path, "cpu", torch.float32, MAX_POS)
    seq = list(range(3, 30))
    assert rel_err(OurRunner(ours).chunk(seq), hf_logits(hf, seq)) < REL_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@torch.no_grad()
def test_half_precision_compute_smoke(fp32_target, dtype):
    """Running in bf16 / fp16: parameters and cache in that dtype, logits float32, finite and near
    the float32 result."""
    ours = load_target(fp32_target, "cpu", dtype, MAX_POS)
    assert all(p.dtype == dtype for p in ours.parameters())
    ref_model = load_target(fp32_target, "cpu", torch.float32, MAX_POS)
    seq = list(range(3, 30))
    runner = OurRunner(ours)
    assert runner.cache.k.dtype == dtype
    logits = runner.chunk(seq)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert rel_err(logits, OurRunner(ref_model).chunk(seq)) < 5e-2


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_llm_generates_in_half_precision(fp32_target, tmp_path, dtype):
    make_drafter(tmp_path / "drafter", fp32_target)
    llm = LLM(fp32_target, tmp_path / "drafter", device="cpu", dtype=dtype, max_model_len=64)
    assert next(llm.target.parameters()).dtype == getattr(torch, dtype)
    for budget in ("ar", "chain", 16):
        result = llm.generate([3, 4, 5], SamplingParams(max_tokens=10, ignore_eos=True), budget)
        assert len(result.token_ids) == 10 and all(0 <= t < 96 for t in result.token_ids)
