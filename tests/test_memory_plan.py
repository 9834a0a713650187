"""The memory plan (ddtree.memory_plan) against the tensors a loaded engine really holds: every
figure is compared, as an exact integer, with the `nbytes` of what ddtree allocated on the CPU."""
from __future__ import annotations

import pytest
import torch

from ddtree import engine as engine_module
from ddtree import memory_plan as plan
from ddtree.config import MAX_TREE_BUDGET, SamplingParams
from ddtree.llm import DEFAULT_TREE_BUDGET, LLM
from ddtree.logprobs import MAX_LOGPROBS
from ddtree.models.configs import DrafterConfig, TargetConfig
from ddtree.models.known_shapes import named_pair
from ddtree.models.loading import DTYPES, load_drafter
from ddtree.tree_shape import AR, CHAIN, TreeShape
from tiny_models import make_drafter, make_hybrid_target, make_target

MAX_LEN = 40
HOST_COPIES = {"summary_host", "host"}  # page-locked host memory on CUDA, not device memory


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted once)."""
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def held_tensors(obj, seen=None) -> list[torch.Tensor]:
    """Every tensor reachable from an engine through ddtree's objects, modules, dicts, lists and
    tuples, except the host copies of a round's results."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in held_tensors(value, seen)]
    if isinstance(obj, (list, tuple)):
        return [t for value in obj for t in held_tensors(value, seen)]
    if isinstance(obj, torch.nn.Module) or type(obj).__module__.startswith("ddtree"):
        return [t for name, value in vars(obj).items() if name not in HOST_COPIES for t in held_tensors(value, seen)]
    return []


def sum_nbytes(*tensors) -> int:
    return sum(t.nbytes for t in tensors)


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """A tiny hybrid target with a drafter of one sliding-window and one full layer."""
    root = tmp_path_factory.mktemp("hybrid")
    make_hybrid_target(root / "target", max_positions=1024)
    make_drafter(root / "drafter", root / "target", layers=2, layer_types=["sliding_attention", "full_attention"],
                 sliding_window=8)
    return root / "target", root / "drafter"


@pytest.fixture(scope="module")
def llama_target(tmp_path_factory):
    """A dense target without q/k norms and with an untied LM head; returns (path, transformers model)."""
    path = tmp_path_factory.mktemp("llama") / "target"
    return path, make_target(path, "llama", tie=False)


def generate_a_little(llm: LLM, budget) -> None:
    llm.generate([3, 5, 7, 9], SamplingParams(max_tokens=6, ignore_eos=True), tree_budget=budget)


# -- constants shared with the engine --------------------------------------------------------------

def test_constants_match_the_engine():
    assert plan.MAX_LOGPROBS == MAX_LOGPROBS
    assert plan.PREFILL_PAD_MAX == engine_module.PREFILL_PAD_MAX
    assert plan.DEFAULT_TREE_BUDGET == DEFAULT_TREE_BUDGET
    assert set(plan.DTYPE_BYTES) == set(DTYPES)
    for name, dtype in DTYPES.items():
        assert plan.dtype_bytes(name) == torch.empty(0, dtype=dtype).element_size()
    for limit in (1, 15, 16, 100, 1024, 5000):
        assert plan.prefill_lengths(limit) == engine_module.prefill_lengths(limit)


# -- weights ---------------------------------------------------------------------------------------

def test_parameter_counts_match_transformers_and_the_loaded_models(llama_target, hybrid_pair, tmp_path):
    path, hf = llama_target
    cfg = TargetConfig.from_dir(path)
    assert plan.target_parameter_count(cfg) == sum(p.numel() for p in hf.parameters())
    hybrid_hf = make_hybrid_target(tmp_path / "h", seed=3)
    assert plan.target_parameter_count(TargetConfig.from_dir(tmp_path / "h")) == \
        sum(p.numel() for p in hybrid_hf.parameters())
    target, draft = hybrid_pair
    tcfg = TargetConfig.from_dir(target)
    drafter = load_drafter(draft, tcfg, "cpu", torch.float32, 16)  # before fuse_projections
    assert plan.drafter_parameter_count(DrafterConfig.from_dir(draft)) == sum(p.numel() for p in drafter.parameters())


def test_known_shapes_parameter_counts():
    # Qwen3-8B's published count; Qwen3.6-27B's text model as transformers builds it (26.9 B, DESIGN.md 6).
    assert plan.target_parameter_count(named_pair("qwen3-8b")[0]) == 8_190_735_360
    assert 26.85e9 < plan.target_parameter_count(named_pair("qwen3.6-27b")[0]) < 26.95e9
    from ddtree.models.drafter import DFlashDrafter
    from ddtree.models.hybrid import HybridTarget
    from ddtree.models.target import TargetModel

    for name in ("qwen3-8b", "qwen3.6-27b"):  # ddtree's own modules at full size, on the meta device
        target, drafter = named_pair(name)
        with torch.device("meta"):
            model = (HybridTarget if target.hybrid else TargetModel)(target, 1)
            draft_model = DFlashDrafter(drafter, 1)
        assert plan.target_parameter_count(target) == sum(p.numel() for p in model.parameters())
        assert plan.drafter_parameter_count(drafter) == sum(p.numel() for p in draft_model.parameters())


# -- a dense pair, figure by figure, then the whole engine ---------------------------------------

def test_dense_pair_figures_equal_the_engine_tensors(demo_pair):
    target, draft = demo_pair
    llm = LLM(target, draft, device="cpu", dtype="float32", max_model_len=MAX_LEN)
    engine, tcfg, dcfg = llm.engine, TargetConfig.from_dir(target), DrafterConfig.from_dir(draft)
    slots = plan.cache_slots(MAX_LEN, kv_bucket=1)
    assert engine.cache.slots == slots == MAX_LEN + MAX_TREE_BUDGET + 2
    assert sum_nbytes(engine.cache.k, engine.cache.v) == slots * plan.target_kv_bytes_per_token(tcfg, "float32")
    assert sum_nbytes(engine.draft_cache.k, engine.draft_cache.v) == \
        slots * plan.drafter_kv_bytes_per_token(dcfg, "float32")
    assert storage_bytes(llm.target.parameters()) == plan.target_weight_bytes(tcfg, "float32")
    drafter_weights = [*llm.drafter.parameters(), *(t for t in llm.drafter.context_kv if t is not None)]
    assert storage_bytes(drafter_weights) == plan.drafter_weight_bytes(dcfg, "float32")
    positions = plan.table_positions(MAX_LEN)
    assert llm.target.rotary.cos_sin.nbytes == plan.rotary_table_bytes(tcfg.rope, tcfg.head_dim, positions, "float32")
    assert llm.drafter.rotary.cos_sin.nbytes == plan.rotary_table_bytes(dcfg.rope, dcfg.head_dim, positions, "float32")
    assert plan.recurrent_state_bytes(tcfg, "float32") == 0


@pytest.mark.parametrize("budget", [AR, CHAIN, TreeShape.best(5)])
def test_round_buffers_equal_the_engine_tensors(demo_pair, hybrid_pair, budget):
    for target, draft, dtype in (*[(*demo_pair, "float32")], (*hybrid_pair, "bfloat16")):
        llm = LLM(target, draft, device="cpu", dtype=dtype, max_model_len=MAX_LEN)
        llm.engine.prepare(budget)
        held = storage_bytes(held_tensors(llm.engine.buffers[budget]))
        assert held == plan.round_buffer_bytes(TargetConfig.from_dir(target), DrafterConfig.from_dir(draft), budget, dtype)


def test_dense_engine_holds_exactly_the_plan(demo_pair):
    target, draft = demo_pair
    llm = LLM(target, draft, device="cpu", dtype="float32", max_model_len=MAX_LEN)
    generate_a_little(llm, 6)
    expected = plan.PairMemory(TargetConfig.from_dir(target), DrafterConfig.from_dir(draft), "float32", TreeShape.best(6),
                                graphs=False)
    assert storage_bytes(held_tensors(llm.engine)) == expected.total_bytes(MAX_LEN)


def test_target_without_drafter_holds_exactly_the_plan(llama_target):
    path, _ = llama_target
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=MAX_LEN)
    generate_a_little(llm, AR)
    expected = plan.PairMemory(TargetConfig.from_dir(path), None, "float32", AR, graphs=False)
    assert storage_bytes(held_tensors(llm.engine)) == expected.total_bytes(MAX_LEN)


# -- a hybrid pair (bf16: the recurrent state stays float32, the conv window does not) -------------

def test_hybrid_figures_equal_the_engine_tensors(hybrid_pair):
    target, draft = hybrid_pair
    llm = LLM(target, draft, device="cpu", dtype="bfloat16", max_model_len=MAX_LEN)
    engine, tcfg, dcfg = llm.engine, TargetConfig.from_dir(target), DrafterConfig.from_dir(draft)
    assert dcfg.layer_types == ["sliding_attention", "full_attention"] and tcfg.hybrid
    slots = plan.cache_slots(MAX_LEN, kv_bucket=1)
    kv, recurrent = engine.cache.kv, engine.cache.recurrent
    assert sum_nbytes(kv.k, kv.v) == slots * plan.target_kv_bytes_per_token(tcfg, "bfloat16")
    # The sliding-window layer keeps every slot: the drafter cache is [layers, slots, ...].
    assert sum_nbytes(engine.draft_cache.k, engine.draft_cache.v) == \
        slots * plan.drafter_kv_bytes_per_token(dcfg, "bfloat16")
    assert recurrent.state.dtype == torch.float32 and recurrent.conv.dtype == torch.bfloat16
    assert recurrent.bytes == sum_nbytes(recurrent.state, recurrent.conv) == plan.recurrent_state_bytes(tcfg, "bfloat16")
    assert storage_bytes(llm.target.parameters()) == plan.target_weight_bytes(tcfg, "bfloat16")
    scratch = llm.target.new_scratch(17, "cpu", torch.bfloat16)
    assert scratch.bytes == plan.recurrent_scratch_bytes(tcfg, 17, "bfloat16")


def test_hybrid_engine_with_graph_buckets_holds_exactly_the_plan(hybrid_pair):
    """An eager engine with the graphs' KV bucket and padded prefill holds what the graphs plan
    holds, less the graphs' own outputs (which only a GPU captures)."""
    target, draft = hybrid_pair
    llm = LLM(target, draft, device="cpu", dtype="bfloat16", max_model_len=MAX_LEN, kv_bucket=plan.GRAPH_KV_BUCKET,
              padded_prefill=True)
    generate_a_little(llm, 4)
    expected = plan.PairMemory(TargetConfig.from_dir(target), DrafterConfig.from_dir(draft), "bfloat16", TreeShape.best(4))
    assert expected.kv_bucket == llm.engine.kv_bucket
    held = storage_bytes(held_tensors(llm.engine))
    assert held == expected.total_bytes(MAX_LEN) - expected.graph_output_bytes(MAX_LEN)


# -- what graphs hold: one verify's logits per budget, whatever the KV bucket -----------------------

@pytest.mark.parametrize("budget", [AR, CHAIN, TreeShape.best(3)])
def test_front_graphs_and_their_logits(demo_pair, budget):
    target, draft = demo_pair
    llm = LLM(target, draft, device="cpu", dtype="float32", max_model_len=600, kv_bucket=plan.GRAPH_KV_BUCKET)
    engine, tcfg = llm.engine, TargetConfig.from_dir(target)
    engine.prepare(budget)
    nodes = budget.nodes(engine.block_size)
    assert plan.front_graph_count(600, nodes, engine.block_size, engine.kv_bucket) == len(engine.front_kv_lens(budget))
    bufs = engine.buffers[budget]
    assert bufs.logits is None  # only graphs keep logits between rounds
    bufs.logits = torch.full((nodes, tcfg.vocab_size), float("nan"))  # a graphs engine's, from its first capture
    kv_len = engine._front_kv_len(budget, 0)
    with torch.inference_mode():
        direct = engine._front(budget, kv_len).clone()
        shared = engine._front_into_buffer(budget, kv_len)  # what every front graph of the budget captures
    assert shared is bufs.logits and torch.equal(shared, direct)
    assert shared.nbytes == plan.verify_logits_bytes(tcfg, nodes)


# -- the answers ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen3-8b", "qwen3.6-27b"])
def test_max_context_and_sequences_are_the_largest_that_fit(name):
    target, drafter = named_pair(name)
    pair = plan.PairMemory(target, drafter)
    free = 100 * plan.GiB
    longest = pair.max_context_tokens(free)
    assert pair.total_bytes(longest) <= free < pair.total_bytes(longest + 1)
    assert plan.max_context_tokens(free, target, drafter) == longest
    for context in (8192, 32768):
        count = pair.max_sequences(free, context)
        assert count >= 1
        assert pair.total_bytes(context, count) <= free < pair.total_bytes(context, count + 1)
        assert plan.max_sequences(free, context, target, drafter) == count
    assert pair.max_context_tokens(pair.weights) == 0
    assert pair.max_sequences(pair.weights, 8192) == 0


# -- the report ---------------------------------------------------------------------------------------

def test_docs_tables_are_the_module_output():
    """docs/memory.md shows the tables `python -m ddtree.memory_plan --table` prints today."""
    from conftest import REPO
    from ddtree.memory_report import H200_GIB, USABLE, table

    docs = (REPO / "docs" / "memory.md").read_text()
    free = int(round(USABLE * H200_GIB, 1) * plan.GiB)
    for graphs in (True, False):
        assert table(free, "bfloat16", plan.DEFAULT_TREE_BUDGET, graphs) in docs


def test_report_pairs_and_cli(demo_pair, capsys):
    from ddtree.config import DDTreeError
    from ddtree.memory_report import load_pair, main

    target, draft = demo_pair
    assert load_pair(str(target), None)[1] is not None  # the demo target comes with its drafter
    assert load_pair(str(target), "none")[1] is None
    assert load_pair("qwen3.6-27b", None)[0].hybrid
    with pytest.raises(DDTreeError, match="hidden_size"):
        load_pair("qwen3-8b", str(draft))
    main(["--target", str(target), "--draft", "none"])
    out = capsys.readouterr().out
    assert "tree budget ar" in out and "longest context" in out
    with pytest.raises(ValueError, match="needs a drafter"):
        plan.PairMemory(TargetConfig.from_dir(target), None, budget=TreeShape.best(64))
