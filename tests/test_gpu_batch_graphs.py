"""On a CUDA GPU: the batched engine's fixed-shape rounds replayed from CUDA graphs
(ddtree.batch_round) give every row the tokens of its run alone, with rows joining and leaving
from the middle and padding rows in a row bucket; in bf16, replay equals the same rounds run
eagerly with the same kernels and buckets.

Skipped where no GPU is present (the CPU suite runs the same functions eagerly, and the graphs'
logic with a capture as one run and a replay as another: tests/test_batch_uniform_rounds.py)."""
from __future__ import annotations

import pytest
import torch

from ddtree.batch_engine import BatchEngine, longest_region
from ddtree.config import SamplingParams
from ddtree.llm import LLM
from ddtree.tree_shape import AR, CHAIN, TreeShape
from batch_helpers import decode_rows
from tiny_models import make_drafter, make_target

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_LEN = 1024
BUDGETS = [AR, CHAIN, TreeShape.best(16), TreeShape.best(64)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_batch")
    make_target(root / "t", "qwen3", vocab=512, hidden=128, layers=4, max_positions=2048, peak=10.0)
    make_drafter(root / "d", root / "t", block_size=16)
    return root / "t", root / "d"


def cases(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Five requests of different lengths: greedy and sampled (own seeds), the second the shortest,
    so that a middle row leaves first."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, max_tokens in enumerate([96, 24, 80, 64, 48]):
        prompt = torch.randint(2, 500, (int(torch.randint(5, 300, (1,), generator=gen)),), generator=gen).tolist()
        temperature = 0.0 if i % 2 == 0 else 0.8
        out.append((prompt, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=100 + i,
                                           ignore_eos=True)))
    return out


def decode(engine: BatchEngine, requests, budget: TreeShape) -> list[list[int]]:
    """Three rows start, the others join one per round as rows free up (max_rows 4: three live rows
    run in a bucket of 4); each leaves at its max_tokens -> every request's tokens."""
    def free_rows_stay_at_0(engine):
        live = len(engine.sequences)
        assert engine.n[live:].tolist() == [0] * (engine.max_rows - live)  # free and padding rows stay at 0

    return decode_rows(engine, requests, [budget] * len(requests), 3, after_round=free_rows_stay_at_0)


def graph_rounds_against_solo(pair, budget, max_nodes: int, seed: int) -> BatchEngine:
    """Decode cases(seed) on a float32 batched engine with graphs (4 rows, trees of up to max_nodes)
    and assert each row's tokens equal its solo eager run -> the engine, for more checks."""
    target, draft = pair
    solo = LLM(target, draft, device="cuda", dtype="float32", use_graphs=False, max_model_len=MAX_LEN)
    batched = LLM(target, draft, device="cuda", dtype="float32", use_graphs=True, max_model_len=MAX_LEN)
    engine = BatchEngine(batched.target, batched.drafter, MAX_LEN, max_rows=4, max_nodes=max_nodes)
    assert engine.use_graphs
    requests = cases(seed=seed)
    got = decode(engine, requests, budget)
    assert engine.rounds.front_graphs and engine.rounds.back_graphs, "no graph was captured"
    for tokens, (prompt, params) in zip(got, requests):
        assert tokens == solo.generate(prompt, params, budget.json_value).token_ids, (budget, prompt[:8])
    return engine


@pytest.mark.parametrize("budget", BUDGETS, ids=str)
def test_graph_rounds_equal_solo_runs_float32(pair, budget):
    engine = graph_rounds_against_solo(pair, budget, max_nodes=65, seed=1)
    assert engine.pad_rows
    assert {rows for rows, _ in engine.rounds.buffers} >= {4, 2}


def test_graph_rounds_equal_eager_rounds_bf16(pair):
    """bf16 rounds differently in fused kernels: the eager engine uses the same compiled layers,
    KV bucket, row buckets and tree-build kernels, so the two run the same arithmetic."""
    target, draft = pair
    llm = LLM(target, draft, device="cuda", dtype="bfloat16", use_graphs=True, max_model_len=MAX_LEN)
    graphs = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=4, max_nodes=65)
    eager = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=4, max_nodes=65, use_graphs=False,
                        kv_bucket=graphs.kv_bucket, pad_rows=True, compile_layers=True, fused_tree=True)
    requests = cases(seed=2)
    for budget in BUDGETS:
        assert decode(graphs, requests, budget) == decode(eager, requests, budget), budget
    assert graphs.rounds.front_graphs and not eager.rounds.front_graphs


def test_graphs_captured_ahead_serve_every_round_float32(pair):
    """`BatchEngine.capture_all` (what `serve --warmup` runs with --max-num-seqs): every graph a
    round then replays was captured before any request, none is captured while decoding, and each
    row's tokens still equal its solo run."""
    target, draft = pair
    solo = LLM(target, draft, device="cuda", dtype="float32", use_graphs=False, max_model_len=MAX_LEN)
    batched = LLM(target, draft, device="cuda", dtype="float32", use_graphs=True, max_model_len=MAX_LEN)
    engine = BatchEngine(batched.target, batched.drafter, MAX_LEN, max_rows=4, max_nodes=65)
    budget = TreeShape.best(16)
    assert engine.capture_all([AR, budget]) > 0
    fronts, backs = set(engine.rounds.front_graphs), set(engine.rounds.back_graphs)
    requests = cases(seed=3)
    got = decode(engine, requests, budget)
    assert set(engine.rounds.front_graphs) == fronts and set(engine.rounds.back_graphs) == backs
    for tokens, (prompt, params) in zip(got, requests):
        assert tokens == solo.generate(prompt, params, budget.json_value).token_ids, prompt[:8]


@pytest.fixture(scope="module")
def sliding_pair(tmp_path_factory):
    """A drafter with two sliding-window layers (window 64) and a full one, as Qwen3.6's."""
    root = tmp_path_factory.mktemp("gpu_batch_sliding")
    make_target(root / "t", "qwen3", vocab=512, hidden=128, layers=4, max_positions=2048, peak=10.0)
    make_drafter(root / "d", root / "t", block_size=16, layers=3, sliding_window=64,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    return root / "t", root / "d"


@pytest.mark.parametrize("budget", [AR, TreeShape.best(16)], ids=str)
def test_graph_rounds_in_a_small_shared_cache_equal_solo_runs_float32(sliding_pair, budget):
    """Request-sized regions in a cache of one row at the context limit (two or three of these
    requests at a time): rows change hands and regions move under the captured graphs, which read
    each row's first slot from the device (the verify and the drafter's full layers in the prefix
    form, its sliding layers in the mask form); every row equals its solo eager run."""
    target, draft = sliding_pair
    solo = LLM(target, draft, device="cuda", dtype="float32", use_graphs=False, max_model_len=MAX_LEN)
    batched = LLM(target, draft, device="cuda", dtype="float32", use_graphs=True, max_model_len=MAX_LEN)
    engine = BatchEngine(batched.target, batched.drafter, MAX_LEN, max_rows=4, max_nodes=17,
                         cache_slots=longest_region(MAX_LEN, 17, batched.block_size))
    requests = cases(seed=5)
    got = decode_rows(engine, requests, [budget] * len(requests), 3, sized=True)
    assert engine.rounds.front_graphs and engine.regions.used_slots == 0
    for tokens, (prompt, params) in zip(got, requests):
        assert tokens == solo.generate(prompt, params, budget.json_value).token_ids, (budget, prompt[:8])


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    pytest.importorskip("transformers.models.qwen3_5")
    from tiny_models import make_hybrid_target

    root = tmp_path_factory.mktemp("gpu_batch_hybrid")
    make_hybrid_target(root / "t", vocab=512, hidden=128, layers=8, heads=4, kv_heads=2, head_dim=64,
                       linear_key_heads=2, linear_value_heads=4, linear_head_dim=32, max_positions=2048, peak=10.0)
    make_drafter(root / "d", root / "t", block_size=16)
    return root / "t", root / "d"


@pytest.mark.parametrize("budget", [AR, TreeShape.best(16)], ids=str)
def test_hybrid_graph_rounds_equal_solo_runs_float32(hybrid_pair, budget):
    """A hybrid target's batched graph rounds (each row's recurrent layers from its own state, the
    Triton tree and fold kernels, the back's warm-up folding nothing) equal each row's solo run."""
    engine = graph_rounds_against_solo(hybrid_pair, budget, max_nodes=17, seed=4)
    assert engine.hybrid


def test_startup_round_costs_time_a_long_context_on_the_gpu(pair):
    """Without a tune file a GPU's start-up times batched rounds at 64 tokens and at the long
    context (8192, cut here to the 2048-token limit), so a long batch is priced along their slope."""
    from ddtree.bench.tune import resolve_round_costs
    from ddtree.budget_selector import CANDIDATES

    target, draft = pair
    llm = LLM(target, draft, device="cuda", dtype="bfloat16", use_graphs=True, max_model_len=2048, max_num_seqs=2)
    lines: list[str] = []
    table = resolve_round_costs(llm, list(CANDIDATES), log=lines.append)
    assert sorted({p.context for p in table.points}) == [64, 2048 - 33]
    assert {(p.rows, p.budget) for p in table.points} == {(r, b.label) for r in (1, 2) for b in CANDIDATES}
    assert "contexts 64, 2015, in" in lines[-1]
