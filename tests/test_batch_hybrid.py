"""Hybrid targets (Gated DeltaNet and gated attention layers) in the batched engine, float32 on the
CPU: every cache row holds its own recurrent state and conv windows, a packed forward runs each
row's recurrent layers from its own state (a prefill advancing it, a tree verify only reading it),
and each row's commit folds its own accepted path in. Every row's tokens equal its run alone
through the one-request engine: greedy and sampled rows with their own seeds, `ar`, chain and a
tree, rows leaving from the middle (the last row's state moves into the freed row) and joining,
padding rows in a row bucket, mixed budgets (the per-row round), and the graphs' logic (a capture
as one run, a replay as another: the back's warm-up runs with every row not live, and must leave
every state as it was)."""
from __future__ import annotations

import pytest
import torch

from ddtree.batch_engine import BatchEngine
from ddtree.config import SamplingParams
from ddtree.llm import LLM
from ddtree.tree_shape import AR, CHAIN, TreeShape
from batch_helpers import decode_rows, replayed
from tiny_models import make_drafter, make_hybrid_target

MAX_LEN = 96
VOCAB = 96
B8 = TreeShape.best(8)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    pytest.importorskip("transformers.models.qwen3_5")
    root = tmp_path_factory.mktemp("batch-hybrid")
    make_hybrid_target(root / "t", vocab=VOCAB)
    make_drafter(root / "d", root / "t", block_size=8)
    return LLM(root / "t", root / "d", device="cpu", dtype="float32", max_model_len=MAX_LEN)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB - 1, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


CASES = [  # the second row finishes first, so the last row moves into its cache row
    (prompt(20, 1), SamplingParams(max_tokens=14, ignore_eos=True)),
    (prompt(7, 2), SamplingParams(max_tokens=4, temperature=0.8, seed=5, ignore_eos=True)),
    (prompt(33, 3), SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)),
    (prompt(12, 4), SamplingParams(max_tokens=9, ignore_eos=True)),
]


def solo(llm, case, budget) -> list[int]:
    tokens, params = case
    return llm.generate(tokens, params, tree_budget=budget.json_value).token_ids


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "replayed"])
@pytest.mark.parametrize("budget", [AR, CHAIN, B8], ids=str)
def test_uniform_rounds_equal_solo_runs(llm, budget, graphs, monkeypatch):
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=4, max_nodes=9, kv_bucket=32, pad_rows=True)
    assert engine.hybrid and len(engine.row_states) == 4
    if graphs:
        replayed(engine, monkeypatch)
    moves, move = [], engine._move
    monkeypatch.setattr(engine, "_move", lambda seq, row: (moves.append((seq.row, row)), move(seq, row)))
    got = decode_rows(engine, CASES, [budget] * len(CASES), join_after=3)
    assert (2, 1) in moves  # the second row left first: the third moved into its row, state and all
    if graphs:
        assert engine.rounds.back_graphs and engine.rounds.front_graphs
    for tokens, case in zip(got, CASES):
        assert tokens == solo(llm, case, budget), (budget, case[0][:4])


def test_mixed_budgets_equal_solo_runs(llm):
    """Rows at `ar`, chain and a tree together take the per-row round; each row's verify stashes
    into its own scratch and commits into its own state. Prompts are prefilled padded to the next
    prefill length (the recurrent layers stop at the prompt's end)."""
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=4, max_nodes=9, padded_prefill=True)
    assert engine.prefill_lengths and all(len(ids) not in engine.prefill_lengths for ids, _ in CASES)
    budgets = [B8, AR, CHAIN, B8]
    got = decode_rows(engine, CASES, budgets, join_after=4)
    for tokens, case, budget in zip(got, CASES, budgets):
        assert tokens == solo(llm, case, budget), (budget, case[0][:4])


def test_a_commit_of_no_nodes_leaves_the_state(llm):
    """A padding row's commit (length 0) leaves its recurrent state and conv windows bit for bit,
    as the back's warm-up under capture needs; a commit of one node changes them."""
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=2, max_nodes=9)
    seq, _ = engine.add(prompt(10, 9), SamplingParams(max_tokens=4), B8)
    engine.step()
    state = engine.row_states[seq.row]
    before = state.state.clone(), state.conv.clone()
    kept = torch.arange(3)
    engine.commit_row(seq.row, seq.first_slot + seq.n, kept, torch.tensor(0), 9)
    assert torch.equal(state.state, before[0]) and torch.equal(state.conv, before[1])
    engine.commit_row(seq.row, seq.first_slot + seq.n, kept, torch.tensor(1), 9)
    assert not torch.equal(state.state, before[0])


def test_llm_generate_with_several_prompts_batches_a_hybrid_when_asked(llm, tmp_path_factory):
    """`LLM(max_num_seqs=N)` batches a hybrid target (by default it decodes one request at a
    time): several prompts through `generate` equal their one-at-a-time runs."""
    assert llm.max_num_seqs == 1
    batched = LLM(llm.target_path, llm.draft_path, device="cpu", dtype="float32", max_model_len=MAX_LEN,
                  max_num_seqs=3)
    prompts, params = [ids for ids, _ in CASES], [p for _, p in CASES]
    got = batched.generate(prompts, params, B8.json_value)
    assert batched._batch is not None and batched._batch.engine.hybrid
    assert [r.token_ids for r in got] == [solo(llm, case, B8) for case in CASES]


def test_graphs_captured_ahead_stay_when_the_stash_is_sized_for_the_largest_budget(llm, monkeypatch):
    """`capture_all` sizes each row's verify stash for its largest budget first, so that no
    capture is dropped by a later, larger budget growing it; rows then replay only those graphs
    and equal their solo runs. A larger budget arriving later grows the stash and drops the graphs."""
    engine = replayed(BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=4, max_nodes=17, kv_bucket=32,
                                  pad_rows=True), monkeypatch)
    monkeypatch.setattr(engine, "use_graphs", True)
    captured = engine.capture_all([AR, B8])
    fronts, backs = set(engine.rounds.front_graphs), set(engine.rounds.back_graphs)
    assert captured == len(fronts) + len(backs) and {key[1] for key in backs} == {AR, B8}
    assert engine.row_scratch[0].nodes == B8.nodes(engine.block_size)
    got = decode_rows(engine, CASES, [B8] * len(CASES), join_after=3)
    assert set(engine.rounds.front_graphs) == fronts and set(engine.rounds.back_graphs) == backs
    for tokens, case in zip(got, CASES):
        assert tokens == solo(llm, case, B8), case[0][:4]
    b16 = TreeShape.best(16)
    got = decode_rows(engine, CASES[:1], [b16], join_after=1)
    assert engine.row_scratch[0].nodes == b16.nodes(engine.block_size)
    assert all(key[1] == b16 for key in engine.rounds.back_graphs)  # the smaller budgets' graphs were dropped
    assert got[0] == solo(llm, CASES[0], b16)


@pytest.mark.parametrize("budget", [AR, B8], ids=str)
def test_prompts_prefilled_through_a_one_request_engine_equal_solo_runs(llm, budget):
    """Padded prompts prefilled by a one-request `Engine` (as an LLM's prefill graphs do on a GPU)
    and copied into their rows (KV, recurrent state and conv window, the drafter's context): every
    row still equals its solo run, rows moving and joining, and the engine ran every prefill."""
    from ddtree.engine import Engine

    donor = Engine(llm.target, llm.drafter, MAX_LEN, padded_prefill=True)
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=4, max_nodes=9, padded_prefill=True,
                         prefill_engine=donor)
    ran = []
    prefill = donor.prefill_padded
    donor.prefill_padded = lambda prompt: (ran.append(len(prompt)), prefill(prompt))[1]
    got = decode_rows(engine, CASES, [budget] * len(CASES), join_after=3)
    assert sorted(ran) == sorted(len(case[0]) for case in CASES)
    for tokens, case in zip(got, CASES):
        assert tokens == solo(llm, case, budget), (budget, case[0][:4])


def test_a_prefill_engine_must_pad_alike(llm):
    from ddtree.engine import Engine

    with pytest.raises(ValueError, match="same lengths"):
        BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=2, padded_prefill=True,
                    prefill_engine=Engine(llm.target, llm.drafter, MAX_LEN, padded_prefill=False))
