"""The batched engine's fixed-shape round (ddtree.batch_round), taken when every row has one tree
shape, in float32 on the CPU (where it runs eagerly; its CUDA graphs need a GPU): every row's
tokens equal its run alone through the one-request engine at `ar`, chain and a tree, greedy and
sampled with per-row seeds, with padding rows in the row bucket, rows leaving from the middle (the
last row moves into the freed one) and joining, a shared KV length larger than a row needs, a
drafter with sliding-window layers, and log-probs. Mixed budgets take the per-row round. The
graphs' logic runs on the CPU too, each capture standing in as one run of its function (what a
capture's warm-up does) and each replay as another: the warm-ups leave the tokens alone."""
from __future__ import annotations

import pytest

from ddtree.batch_engine import BatchEngine, longest_region
from ddtree.batch_round import row_bucket
from ddtree.config import SamplingParams
from ddtree.llm import LLM
from ddtree.tree_shape import AR, CHAIN, TreeShape
from batch_helpers import decode_rows, replayed
from tiny_models import make_drafter, make_target

MAX_LEN = 80
B8 = TreeShape.best(8)


@pytest.fixture(scope="module")
def llm(demo_pair):
    return LLM(*demo_pair, device="cpu", max_model_len=MAX_LEN)


def params(temperature=0.0, seed=None, max_tokens=12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=True, **kw)


ROWS = [  # (prompt, sampling): a greedy row and two sampled rows with their own seeds
    ("def fib(n):", params()),
    ("class Stack:", params(0.8, seed=7)),
    ("for i in range(", params(0.6, seed=3, top_k=20)),
]


def solo(llm, prompt, sampling, budget) -> list[int]:
    return llm.generate(prompt, sampling, tree_budget=budget.json_value).token_ids


class Counted:
    """Counts the rounds each path takes on `engine` (wrapping its two round methods)."""

    def __init__(self, engine, monkeypatch):
        self.uniform = self.mixed = 0
        launch, mixed = engine.rounds.launch, engine._mixed_step

        def counted_launch(*args):
            self.uniform += 1
            return launch(*args)

        def counted_mixed(*args):
            self.mixed += 1
            return mixed(*args)

        monkeypatch.setattr(engine.rounds, "launch", counted_launch)
        monkeypatch.setattr(engine, "_mixed_step", counted_mixed)


def assert_free_rows_idle(engine):
    """Rows past the live ones (the padding rows of a bucket among them) hold n = 0 and are not live."""
    live = len(engine.sequences)
    assert sorted(seq.row for seq in engine.sequences) == list(range(live))
    assert engine.n[live:].tolist() == [0] * (engine.max_rows - live)
    assert engine.live.tolist() == [True] * live + [False] * (engine.max_rows - live)
    assert engine.n[:live].tolist() == [seq.n for seq in sorted(engine.sequences, key=lambda s: s.row)]


def decode(engine, llm, cases, budget, join_after=None):
    """Add `cases` [(prompt, sampling)] (those past `join_after` rows one round each later), step
    until each has its max_tokens -> every case's tokens, in order."""
    requests = [(llm.encode(prompt), sampling) for prompt, sampling in cases]
    return decode_rows(engine, requests, [budget] * len(cases), len(cases) if join_after is None else join_after,
                       after_round=assert_free_rows_idle)


def test_row_buckets():
    assert [row_bucket(r, 16) for r in range(1, 17)] == [1, 2, 4, 4, 8, 8, 8, 8] + [16] * 8
    assert [row_bucket(r, 12) for r in (5, 8, 9, 12)] == [8, 8, 12, 12]


@pytest.mark.parametrize("budget", [AR, CHAIN, B8], ids=str)
def test_uniform_rounds_with_a_padding_row_equal_solo_runs(llm, budget, monkeypatch):
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=4, max_nodes=16, pad_rows=True)
    counted = Counted(engine, monkeypatch)
    got = decode(engine, llm, ROWS, budget)  # 3 live rows in a bucket of 4
    assert (4, budget) in engine.rounds.buffers and counted.uniform > 0 and counted.mixed == 0
    for tokens, (prompt, sampling) in zip(got, ROWS):
        assert tokens == solo(llm, prompt, sampling, budget), prompt


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "replayed"])
def test_rows_leaving_from_the_middle_and_joining_equal_solo_runs(llm, monkeypatch, graphs):
    """The middle row finishes first: the last row moves into its row; later rows join into the
    freed rows, and the bucket shrinks and grows with the live rows."""
    cases = [("def fib(n):", params(max_tokens=16)), ("import os\n", params(0.7, seed=5, max_tokens=4)),
             ("class Stack:", params(1.0, seed=11, max_tokens=16)), ("x = [1, 2", params(max_tokens=10))]
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=4, max_nodes=9, kv_bucket=32, pad_rows=True)
    if graphs:
        replayed(engine, monkeypatch)
    moves = []
    move = engine._move
    monkeypatch.setattr(engine, "_move", lambda seq, row: (moves.append((seq.row, row)), move(seq, row)))
    counted = Counted(engine, monkeypatch)
    got = decode(engine, llm, cases, B8, join_after=3)
    assert (2, 1) in moves and counted.mixed == 0 and counted.uniform > 0
    assert {rows for rows, _ in engine.rounds.buffers} >= {2, 4}
    if graphs:  # a back per row bucket, a front per row bucket and KV bucket
        assert set(engine.rounds.back_graphs) == {(rows, B8, True) for rows, _ in engine.rounds.buffers}
        assert {key[2] for key in engine.rounds.front_graphs} >= {32, 64}
    for tokens, (prompt, sampling) in zip(got, cases):
        assert tokens == solo(llm, prompt, sampling, B8), prompt


def test_ar_rounds_feed_the_drafter_for_later_trees_under_replayed_graphs(llm, monkeypatch):
    """Rows that feed the drafter run `ar` rounds (their back writes each token's drafter context),
    then trees: they draft as requests whose prompts hold those tokens do. Each back's warm-up runs
    just before a front, on the buffers' stale tree, and changes nothing that is read."""
    engine = replayed(BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=4, max_nodes=9, pad_rows=True),
                      monkeypatch)
    prompts = ["def quicksort(xs):", "import os\n", "class Stack:"]
    seqs, tokens, lengths = [], [], []
    for prompt in prompts:
        seq, step = engine.add(llm.encode(prompt), params(), AR, feeds_drafter=True)
        seqs.append(seq)
        tokens.append(list(step.tokens))
        lengths.append([])
    for round_ in range(8):
        if round_ == 3:
            for seq in seqs:
                engine.set_budget(seq, B8)
        for seq, step in engine.step():
            tokens[seqs.index(seq)] += step.tokens
            lengths[seqs.index(seq)].append(step.acceptance_length)
        assert_free_rows_idle(engine)
    assert set(engine.rounds.back_graphs) == {(4, AR, True), (4, B8, True)}
    assert max(max(row[3:]) for row in lengths) > 1  # the drafter's guesses are worth checking
    for i, prompt in enumerate(prompts):
        assert lengths[i][:3] == [1, 1, 1]
        later = llm.generate(llm.encode(prompt) + tokens[i][:3], params(max_tokens=len(tokens[i]) - 3), tree_budget=8)
        assert tokens[i][3:] == later.token_ids, prompt
        assert lengths[i][3:] == later.stats.acceptance_lengths[:5], prompt


def test_mixed_budgets_take_the_per_row_round_and_equal_solo_runs(llm, monkeypatch):
    """(Prompts prefilled padded to the next prefill length, as on CUDA.)"""
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=3, max_nodes=9, pad_rows=True,
                         padded_prefill=True)
    assert engine.prefill_lengths
    counted = Counted(engine, monkeypatch)
    budgets = [B8, AR, B8]
    seqs, tokens = [], []
    for (prompt, sampling), budget in zip(ROWS, budgets):
        seq, step = engine.add(llm.encode(prompt), sampling, budget)
        seqs.append(seq)
        tokens.append(list(step.tokens))
    for _ in range(3):  # mixed: the per-row round
        for seq, step in engine.step():
            tokens[seqs.index(seq)] += step.tokens
    assert counted.mixed == 3 and counted.uniform == 0
    engine.remove(seqs[1])  # the `ar` row leaves (from the middle): the rest share one shape
    while any(len(tokens[i]) < ROWS[i][1].max_tokens for i in (0, 2)):
        for seq, step in engine.step():
            tokens[seqs.index(seq)] += step.tokens
        assert_free_rows_idle(engine)
    assert counted.uniform > 0 and counted.mixed == 3
    for i in (0, 2):
        prompt, sampling = ROWS[i]
        assert tokens[i][:sampling.max_tokens] == solo(llm, prompt, sampling, B8), prompt


def test_logprobs_in_a_uniform_round_equal_the_solo_run(llm):
    sampling = params(max_tokens=10, logprobs=3)
    expected = llm.generate("def fib(n):", sampling, tree_budget=8)
    engine = BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=2, max_nodes=9)
    engine.add(llm.encode("import os\n"), params(), B8)
    seq, step = engine.add(llm.encode("def fib(n):"), sampling, B8)
    logprobs = list(step.logprobs)
    while len(logprobs) < sampling.max_tokens:
        logprobs += next(s for q, s in engine.step() if q is seq).logprobs
    for got, want in zip(logprobs, expected.logprobs):
        assert got.token_id == want.token_id
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


@pytest.fixture(scope="module")
def sliding_llm(tmp_path_factory):
    """A tiny random pair whose drafter has a sliding-window layer (its metas go row by row)."""
    root = tmp_path_factory.mktemp("sliding")
    make_target(root / "t", "qwen3")
    make_drafter(root / "d", root / "t", block_size=8, layer_types=["sliding_attention", "full_attention"],
                 sliding_window=6)
    return LLM(root / "t", root / "d", device="cpu", dtype="float32", max_model_len=64)


@pytest.mark.parametrize("budget", [CHAIN, B8], ids=str)
def test_a_sliding_window_drafter_in_uniform_rounds_equals_solo_runs(sliding_llm, budget):
    llm = sliding_llm
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21]]
    cases = [(p, params(max_tokens=16)) for p in prompts]
    engine = BatchEngine(llm.target, llm.drafter, 64, max_rows=4, max_nodes=9, pad_rows=True)
    encode = llm.encode
    try:
        llm.encode = lambda ids: ids  # the prompts are token ids already
        got = decode(engine, llm, cases, budget)
    finally:
        llm.encode = encode
    for tokens, (prompt, sampling) in zip(got, cases):
        assert tokens == solo(llm, prompt, sampling, budget), prompt


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "replayed"])
def test_rows_in_a_small_shared_cache_equal_solo_runs(sliding_llm, monkeypatch, graphs):
    """Request-sized regions in a cache that holds two requests at a time: rows join as regions
    free up, change hands (a row's first slot is the device table's), pad to a bucket over the
    spare slots, and the sliding-window drafter's masks follow each row's region; every row equals
    its solo run."""
    llm = sliding_llm
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21], [30, 31, 32, 33, 34], [40, 41, 42]]
    cases = [(p, params(max_tokens=n)) for p, n in zip(prompts, [16, 6, 12, 9, 14])]
    largest = 7 + 16 + 8 + 9 + 1  # prompt, max_tokens, a round ahead (the block), the tree, the bonus
    pool = max(2 * largest + 3, longest_region(64, 9, 8))  # two of the largest regions, a few slots to spare
    engine = BatchEngine(llm.target, llm.drafter, 64, max_rows=4, max_nodes=9, pad_rows=True, kv_bucket=8,
                         cache_slots=pool)
    assert engine.region_slots(7, 16, 9) == largest and 3 * largest > pool
    if graphs:
        replayed(engine, monkeypatch)
    got = decode_rows(engine, cases, [B8] * len(cases), 3, after_round=assert_free_rows_idle, sized=True)
    assert engine.regions.used_slots == 0
    for tokens, (prompt, sampling) in zip(got, cases):
        assert tokens == solo(llm, prompt, sampling, B8), prompt


def test_graphs_captured_ahead_serve_every_round_and_change_no_tokens(llm, monkeypatch):
    """`BatchEngine.capture_all` before any request: every (row bucket, budget, KV length) a round
    then meets is already captured (no capture while decoding), and the warm-ups, run on free
    rows, leave every row's tokens equal to its solo run."""
    engine = replayed(BatchEngine(llm.target, llm.drafter, MAX_LEN, max_rows=4, max_nodes=9, kv_bucket=32,
                                  pad_rows=True), monkeypatch)
    monkeypatch.setattr(engine, "use_graphs", True)
    captured = engine.capture_all([AR, B8])
    fronts, backs = set(engine.rounds.front_graphs), set(engine.rounds.back_graphs)
    assert captured == len(fronts) + len(backs)
    assert backs == {(rows, budget, feeds) for rows in (1, 2, 4) for budget, feeds in ((AR, False), (AR, True), (B8, True))}
    assert {kv for rows, budget, kv, _ in fronts if budget == B8} == set(engine.uniform_kv_lens(B8))
    # A round reads n + 16 slots (the block is longer than B8's 9 nodes), n from 1 to MAX_LEN plus a
    # round launched ahead (16 more): 17..112, the last bucket cut at the row's 113 slots.
    assert engine.uniform_kv_lens(B8) == engine.uniform_kv_lens(AR) == [32, 64, 96, 113]
    assert_free_rows_idle(engine)
    cases = [("def fib(n):", params(max_tokens=16)), ("import os\n", params(0.7, seed=5, max_tokens=4)),
             ("class Stack:", params(1.0, seed=11, max_tokens=16))]
    for budget in (B8, AR):
        got = decode(engine, llm, cases, budget, join_after=2)
        for tokens, (prompt, sampling) in zip(got, cases):
            assert tokens == solo(llm, prompt, sampling, budget), (budget, prompt)
    assert set(engine.rounds.front_graphs) == fronts and set(engine.rounds.back_graphs) == backs
    assert engine.capture_all([AR, B8]) == 0  # nothing left to capture


def test_tree_kernels_build_every_row_at_once_and_equal_solo_runs(sliding_llm, monkeypatch):
    """With the tree build's kernels (`fused_tree`; Triton's interpreter here) a round builds every
    row's tree in one `TreeBuildPlan.build` (padding rows included), and each row's tokens equal
    its solo run."""
    from ddtree.kernels.tree_build import TreeBuildPlan

    llm = sliding_llm
    builds = []
    build = TreeBuildPlan.build
    monkeypatch.setattr(TreeBuildPlan, "build", lambda self, logp, *a: (builds.append(logp.shape[0]),
                                                                         build(self, logp, *a)))
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [20, 21]]  # 3 rows in a bucket of 4
    cases = [(p, params(max_tokens=3)) for p in prompts]
    engine = BatchEngine(llm.target, llm.drafter, 64, max_rows=4, max_nodes=9, pad_rows=True, fused_tree=True)
    counted = Counted(engine, monkeypatch)
    monkeypatch.setattr(llm, "encode", lambda ids: ids)  # the prompts are token ids already
    got = decode(engine, llm, cases, B8)
    assert engine.rounds.tree_plans[B8].rows == 4
    assert len(builds) == counted.uniform > 0 and builds[0] == 4  # one build a round, of every row
    for tokens, (prompt, sampling) in zip(got, cases):
        assert tokens == solo(llm, prompt, sampling, B8), prompt
