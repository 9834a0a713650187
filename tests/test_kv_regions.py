"""Request-sized cache regions: the slot allocator (ddtree.kv_regions) against a slot-by-slot model,
the batched engine sharing a pool smaller than its rows at the context limit (more requests at
once than the pool holds of those, each equal to its solo run in float32 on the CPU), a request
held until room comes back, and the pool sized from device memory (ddtree.batch_memory)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddtree.batch_engine import BatchEngine, longest_region
from ddtree.batch_memory import batch_cache_slots, batch_reserve_bytes, kv_bytes_per_slot
from ddtree.config import DDTreeError, SamplingParams, parse_tree_budget
from ddtree.kv_regions import SlotRegions
from ddtree.llm import LLM
from ddtree.memory_plan import GiB

MAX_LEN = 96


# -- the allocator ------------------------------------------------------------------------------

def test_first_fit_lowest_address_and_merging():
    regions = SlotRegions(100)
    a, b, c = regions.allocate(30), regions.allocate(30), regions.allocate(30)
    assert (a, b, c) == (0, 30, 60) and regions.free_slots == 10
    assert regions.allocate(11) is None  # only 10 left, at the end
    regions.release(b)
    assert regions.largest_free == 30 and regions.allocate(25) == 30  # the hole in the middle
    regions.release(30)
    regions.release(a)  # merges with the hole after it
    assert regions.largest_free == 60 and regions.allocate(60) == 0
    regions.release(0)
    regions.release(c)  # merges with both neighbours
    assert regions.free_slots == regions.largest_free == 100 and regions.used_slots == 0


def test_bad_calls_are_refused():
    regions = SlotRegions(10)
    with pytest.raises(ValueError, match="at least one slot"):
        regions.allocate(0)
    with pytest.raises(ValueError, match="no region begins"):
        regions.release(3)
    with pytest.raises(ValueError, match="at least one slot"):
        SlotRegions(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 1000)), max_size=60))
def test_allocator_against_a_slot_by_slot_model(ops):
    """Random allocations and releases: regions never overlap, each is the lowest free run long
    enough (first fit), and the free counts match a bitmap of the pool."""
    total = 120
    regions, used, held = SlotRegions(total), [False] * total, {}
    for allocate, size, pick in ops:
        if allocate or not held:
            start = regions.allocate(size)
            runs = [s for s in range(total - size + 1) if not any(used[s:s + size])]
            assert start == (runs[0] if runs else None)
            if start is not None:
                used[start:start + size] = [True] * size
                held[start] = size
        else:
            start = sorted(held)[pick % len(held)]
            assert regions.size_of(start) == held[start]
            regions.release(start)
            size = held.pop(start)
            used[start:start + size] = [False] * size
        assert regions.free_slots == used.count(False)
        longest = run = 0
        for slot in used:
            run = 0 if slot else run + 1
            longest = max(longest, run)
        assert regions.largest_free == longest


# -- the batched engine on a shared pool --------------------------------------------------------

@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu", max_model_len=MAX_LEN)


def params(max_tokens, temperature=0.0, seed=None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True)


CASES = [  # (prompt, sampling, budget): short requests
    ("def fib(n):", params(12), "ar"),
    ("import os\n", params(10), 16),
    ("class Stack:", params(12, 0.8, seed=7), "chain"),
    ("def quicksort(xs):", params(8, 1.0, seed=11), 16),
    ("for i in range(", params(12, 0.6, seed=3), 8),
]


def test_short_requests_share_a_pool_that_holds_one_long_row(llm):
    """A pool of one row at the context limit holds all five short requests at once, in regions
    sized by their prompts, max_tokens and trees; each equals its solo run, rows move without their
    entries moving, and every region comes back."""
    max_nodes, limit = 17, 260  # (the models' rotary tables cover 260 positions and more)
    pool = longest_region(limit, max_nodes, llm.block_size)
    engine = BatchEngine(llm.target, llm.drafter, limit, max_rows=8, max_nodes=max_nodes, cache_slots=pool)
    seqs, tokens = [], {}
    for prompt, sampling, budget in CASES:
        ids = llm.encode(prompt)
        shape = parse_tree_budget(budget)
        assert engine.fits(len(ids), sampling.max_tokens, shape.nodes(llm.block_size))
        seq, step = engine.add(ids, sampling, shape, max_new=sampling.max_tokens,
                               max_nodes=shape.nodes(llm.block_size))
        assert seq.slots == (len(ids) + sampling.max_tokens + llm.block_size  # a round ahead: the block
                             + max(shape.nodes(llm.block_size), llm.block_size) + 1)
        seqs.append(seq)
        tokens[id(seq)] = list(step.tokens)
    starts = sorted((s.first_slot, s.first_slot + s.slots) for s in seqs)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(starts, starts[1:]))  # no overlap
    assert starts[-1][1] <= pool < len(CASES) * pool
    # A long request does not fit beside them (it would, in an empty pool).
    assert not engine.fits(60, limit - 60, max_nodes)
    by_seq = {id(s): i for i, s in enumerate(seqs)}
    while engine.sequences:
        for seq, step in engine.step():
            tokens[id(seq)] += step.tokens
            if len(tokens[id(seq)]) >= seq.params.max_tokens:
                first = seq.first_slot
                engine.remove(seq)
                assert all(s.first_slot != first for s in engine.sequences)
        live = sorted(engine.sequences, key=lambda s: s.row)
        assert engine.first_slot[:len(live)].tolist() == [s.first_slot for s in live]
        assert engine.first_slot[len(live):].tolist() == [engine.spare_slot] * (engine.max_rows - len(live))
    assert engine.regions.used_slots == 0 and engine.fits(60, limit - 60, max_nodes)
    for seq in seqs:
        prompt, sampling, budget = CASES[by_seq[id(seq)]]
        want = llm.generate(prompt, sampling, tree_budget=budget).token_ids
        assert tokens[id(seq)][:sampling.max_tokens] == want, prompt


def test_a_sequence_keeps_to_its_region_and_its_trees(llm):
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=2, max_nodes=17)
    ids = llm.encode("def fib(n):")
    with pytest.raises(ValueError, match="holds trees of at most 17"):
        engine.add(ids, params(4), parse_tree_budget(8), max_nodes=65)
    seq, _ = engine.add(ids, params(4), parse_tree_budget(8), max_new=4, max_nodes=9)
    with pytest.raises(ValueError, match="holds at most 9"):
        engine.set_budget(seq, parse_tree_budget(16))
    emitted = 1
    while emitted < 4:  # every round its max_new needs runs
        ((_, step),) = engine.step()
        emitted += len(step.tokens)
    with pytest.raises(ValueError, match="no room in its"):  # rounds past them find no room, and say so
        for _ in range(8):
            engine.step()


def test_a_pool_too_small_for_one_long_sequence_is_refused(llm):
    with pytest.raises(ValueError, match="cannot hold one sequence at the context limit"):
        BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=2, max_nodes=17,
                    cache_slots=longest_region(MAX_LEN, 17, llm.block_size) - 1)


def test_full_pool_raises_and_a_full_region_waits(llm):
    pool = longest_region(MAX_LEN, 17, llm.block_size)
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=4, max_nodes=17, cache_slots=pool)
    ids = llm.encode("def fib(n):")
    engine.add(ids, params(4), parse_tree_budget(16))  # no max_new: a region to the context limit
    assert engine.free_rows == 3 and not engine.fits(len(ids), 4, 17)
    with pytest.raises(RuntimeError, match="no free cache region"):
        engine.add(ids, params(4), parse_tree_budget(16), max_new=4)


def test_generate_waits_for_room_and_equals_solo_runs(demo_pair, llm):
    """`LLM.generate` with many prompts on a pool that holds two of them at a time: the others wait
    for room, and every output equals its solo run."""
    small = LLM(*demo_pair, device="cpu", max_model_len=MAX_LEN, max_num_seqs=8,
                kv_cache_tokens=longest_region(MAX_LEN, 65, llm.block_size))
    prompts = [prompt for prompt, _, _ in CASES]
    sampling = params(40)
    batch = small.batched(17)  # the engine generate makes for budget 16
    engine, peak, begin = batch.engine, [], batch.begin
    batch.begin = lambda *a, **k: (peak.append(len(engine.sequences) + 1), begin(*a, **k))[1]
    got = small.generate(prompts, sampling, tree_budget=16)
    assert max(peak) == 2 and len(peak) == len(prompts)  # two regions of ~66 slots fit in 162
    assert engine.cache_slots == longest_region(MAX_LEN, 65, llm.block_size) and engine.regions.used_slots == 0
    for prompt, result in zip(prompts, got):
        assert result.token_ids == llm.generate(prompt, sampling, tree_budget=16).token_ids


# -- sizing from device memory ------------------------------------------------------------------

def test_pool_sized_from_memory(llm):
    target_cfg, drafter_cfg = llm.target.config, llm.drafter.config
    row = longest_region(MAX_LEN, 65, llm.block_size)
    per_slot = kv_bytes_per_slot(target_cfg, drafter_cfg, "float32")
    reserve = batch_reserve_bytes(target_cfg, "float32", 4, 65)
    # a dense target: the logits buffers of 1, 2 and 4 rows for three budgets, and the margin
    assert reserve == (1 + 2 + 4) * 65 * target_cfg.vocab_size * 4 * 3 + GiB
    cuda = torch.device("cuda")
    total = 80 * GiB
    free = total - 10 * GiB  # 10 GiB already held
    room = int(0.5 * total) - 10 * GiB - reserve
    slots = batch_cache_slots(target_cfg, drafter_cfg, "float32", 4, row, 65, cuda, 0.5, memory=(free, total))
    assert slots == min(room // per_slot, 4 * row)
    # never more than every row at the context limit; given outright; the CPU keeps the default
    assert batch_cache_slots(target_cfg, drafter_cfg, "float32", 4, row, 65, cuda, 0.9, memory=(free, total)) == 4 * row
    assert batch_cache_slots(target_cfg, drafter_cfg, "float32", 4, row, 65, cuda, 0.9, kv_cache_tokens=row) == row
    assert batch_cache_slots(target_cfg, drafter_cfg, "float32", 4, row, 65, torch.device("cpu"), 0.9) is None
    with pytest.raises(DDTreeError, match="fewer than one sequence at the context limit needs"):
        batch_cache_slots(target_cfg, drafter_cfg, "float32", 4, row, 65, cuda, 0.13, memory=(free, total))
    with pytest.raises(DDTreeError, match="cannot hold one sequence"):
        batch_cache_slots(target_cfg, drafter_cfg, "float32", 4, row, 65, cuda, 0.9, kv_cache_tokens=row - 1)
    with pytest.raises(DDTreeError, match=r"must be in \(0, 1\]"):
        batch_cache_slots(target_cfg, drafter_cfg, "float32", 4, row, 65, cuda, 1.5, memory=(free, total))
