"""Long prompts prefilled in chunks (ddtree.engine.prefill_chunks) against one forward over the
whole prompt, in float32 on the CPU, for a dense and a hybrid target (Gated DeltaNet layers
advance their state chunk by chunk):

- the last prompt token's logits, the target's caches (KV slots, recurrent state and conv window)
  and the drafter's context are the same, and the chunked engine did run chunk-sized forwards;
- greedy generation (ar and tree budget 8) gives the same tokens;
- the batched engine's rows with long prompts equal their one-request runs (a hybrid's rows each
  with its own recurrent state).

Prompts of 50 tokens end with a chunk of 2 (shorter than the conv window), of 64 on a boundary.
"""
from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ddtree import LLM, SamplingParams, parse_tree_budget
from ddtree.engine import prefill_chunks
from ddtree.models.hybrid import LOOP_MAX_TOKENS
from tiny_models import make_drafter, make_hybrid_target, make_target

CHUNK = 16
PROMPT_LENS = [50, 64]
MAX_LEN = 256
VOCAB = 96
# float32 noise: a hybrid's later chunks run the recurrence as a token loop (or chunked form) from
# the prefix's state, one forward runs it in 64-token chunks from zero; both are ~5e-5 off a
# float64 oracle on logits of ~15 (transformers' Qwen3_5ForCausalLM, measured). A wrong state,
# conv window or mask is off by far more.
TOL = dict(rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", params=["dense", "hybrid"])
def pair(request, tmp_path_factory):
    """(LLM prefilling in chunks of CHUNK, LLM prefilling in one forward) of one tiny pair."""
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "dense":
        make_target(root / "target", "qwen3", vocab=VOCAB)
    else:
        pytest.importorskip("transformers.models.qwen3_5")
        make_hybrid_target(root / "target", vocab=VOCAB)
    make_drafter(root / "drafter", root / "target", block_size=8)
    kw = dict(device="cpu", dtype="float32", max_model_len=MAX_LEN)
    chunked = LLM(root / "target", root / "drafter", prefill_chunk=CHUNK, max_num_seqs=4, **kw)
    whole = LLM(root / "target", root / "drafter", **kw)
    assert whole.engine.prefill_chunk >= MAX_LEN and not chunked.engine.prefill_lengths
    return chunked, whole


def random_prompt(length: int, seed: int = 0) -> list[int]:
    return torch.randint(2, VOCAB - 1, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def forward_lengths(monkeypatch, model) -> list[int]:
    """The token count of each forward of `model` from now on."""
    lengths, forward = [], model.forward

    def counted(tokens, *args, **kwargs):
        lengths.append(tokens.shape[0])
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    return lengths


def prefilled(llm: LLM, prompt: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Prefill `prompt` with the drafter's context -> (last token's logits [1, V], the target's cache
    of the prompt, the drafter's context of the prompt)."""
    engine, p = llm.engine, len(prompt)
    with torch.inference_mode():
        logits = engine._prefill_chunked(torch.tensor(prompt), engine.feature_layers)
    cache = engine.cache
    if hasattr(cache, "recurrent"):  # a hybrid: KV of its attention layers, then its recurrent state
        target = [cache.kv.k[:, :p], cache.kv.v[:, :p], cache.recurrent.state, cache.recurrent.conv]
    else:
        target = [cache.k[:, :p], cache.v[:, :p]]
    drafter = [engine.draft_cache.k[:, :p], engine.draft_cache.v[:, :p]]
    return logits, [t.clone() for t in target], [t.clone() for t in drafter]


@pytest.mark.parametrize("p", PROMPT_LENS)
def test_chunks_leave_the_logits_and_caches_of_one_forward(pair, p, monkeypatch):
    chunked, whole = pair
    prompt = random_prompt(p)
    lengths = forward_lengths(monkeypatch, chunked.target)
    logits, target, drafter = prefilled(chunked, prompt)
    assert lengths == [CHUNK] * (p // CHUNK) + ([p % CHUNK] if p % CHUNK else [])
    want_logits, want_target, want_drafter = prefilled(whole, prompt)
    assert logits.shape == want_logits.shape == (1, VOCAB)
    assert_close(logits, want_logits, **TOL)
    for got, want in zip(target + drafter, want_target + want_drafter):
        assert_close(got, want, **TOL)


def test_chunks_longer_than_the_token_loop(pair):
    """Chunks of 70 tokens: a hybrid runs the recurrence's chunked form from the prefix's state
    (CHUNK's 16 run the token loop, as the last chunk of 10 here does)."""
    _, whole = pair
    model, prompt = whole.target, torch.tensor(random_prompt(150, seed=5))
    assert 70 > LOOP_MAX_TOKENS
    results = []
    for chunk in (70, 150):
        cache = model.new_cache(160, "cpu", torch.float32)
        with torch.inference_mode():
            for rows, meta, last in prefill_chunks(150, chunk, "cpu"):
                logits, _ = model(prompt[rows], meta.write_slots, meta, cache, None, logit_rows=last)
        results.append(logits)
    assert_close(results[0], results[1], **TOL)


@pytest.mark.parametrize("budget", ["ar", 8])
@pytest.mark.parametrize("p", PROMPT_LENS)
def test_greedy_generation_is_the_same(pair, p, budget):
    chunked, whole = pair
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(p, seed=p)
    got = chunked.generate(prompt, params, tree_budget=budget)
    assert got.token_ids == whole.generate(prompt, params, tree_budget=budget).token_ids
    assert len(got.token_ids) == 16


def test_batched_rows_with_long_prompts_equal_their_solo_runs(pair, monkeypatch):
    """Rows prefilled in chunks (each chunk packed as its row alone, a chunk a round beside rows
    mid-decode) equal one-forward solo runs."""
    chunked, whole = pair
    batch = chunked.batched()
    cases = [(random_prompt(50, 1), 8), (random_prompt(5, 2), "ar"), (random_prompt(64, 3), "chain")]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [whole.generate(prompt, params, tree_budget=budget).token_ids for prompt, budget in cases]
    lengths = forward_lengths(monkeypatch, chunked.target)
    outputs = {}

    def step():
        for request, event in batch.step():
            outputs[id(request)][1].extend(event.token_ids)

    for i, (prompt, budget) in enumerate(cases):
        while not batch.free:  # a long prompt's prefill holds the first free row until it is done
            step()
        request, event = batch.add(prompt, params, parse_tree_budget(budget))
        outputs[id(request)] = (i, list(event.token_ids) if event is not None else [])
        step()  # rows join between rounds: a prefill's chunks write beside rows mid-decode
    assert lengths[:4] == [16, 16, 16, 2]  # nothing else was running: a chunk a step, no round
    while batch.busy:
        step()
    for i, tokens in outputs.values():
        assert tokens == expected[i], cases[i][1]


def run_batch(batch, joins: list[tuple], cancel_at: dict[int, int] | None = None, steps: int = 200):
    """Steps `batch`, adding joins[i] = (step, prompt, params, budget) before that step once a row
    is free (in order), and cancelling join i before step cancel_at[i]. -> (tokens per join, the
    steps at which each join got an event)."""
    tokens, seen, handles, keys = {}, {}, {}, {}
    cancel_at = cancel_at or {}
    waiting = list(range(len(joins)))
    for k in range(steps):
        for i, at in cancel_at.items():
            if at == k and i in handles:
                batch.cancel(handles[i])
        while waiting and joins[waiting[0]][0] <= k and batch.free:
            i = waiting.pop(0)
            request, event = batch.add(*joins[i][1:])
            handles[i], keys[id(request)], tokens[i], seen[i] = request, i, [], []
            if event is not None:
                tokens[i] += event.token_ids
        if not waiting and not batch.busy:
            break
        for request, event in batch.step():
            i = keys[id(request)]
            tokens[i] += event.token_ids
            seen[i].append(k)
    return tokens, seen


def test_running_rows_get_a_round_every_step_while_a_long_prompt_joins(pair):
    """A running row is not held up by a long prompt's prefill: one chunk a step after its round."""
    chunked, whole = pair
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    short, long = (random_prompt(6, 4), 8), (random_prompt(50, 5), "chain")
    joins = [(0, short[0], params, parse_tree_budget(short[1])), (2, long[0], params, parse_tree_budget(long[1]))]
    tokens, seen = run_batch(chunked.batched(), joins)
    for i, (prompt, budget) in enumerate((short, long)):
        assert tokens[i] == whole.generate(prompt, params, tree_budget=budget).token_ids
    # 50 tokens are 4 chunks: the first at its add (before step 2's round), then one after each
    # round, so its first token comes with step 4; the running row had a round at every step.
    assert seen[1][0] == 4
    assert all(k in seen[0] for k in range(2, 5))


def test_a_row_leaving_or_a_cancel_during_a_deferred_prefill(pair):
    """A row that finishes while a long prompt is being prefilled frees its row: the prefill under
    way moves down with it (its KV, drafter context and recurrent state so far); a cancelled
    prefill frees its row, and every other row still equals its solo run."""
    chunked, whole = pair
    quick = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    cases = [(0, random_prompt(5, 6), quick, 8), (0, random_prompt(7, 7), params, "ar"),
             (0, random_prompt(64, 8), params, 8), (3, random_prompt(40, 9), params, "chain"),
             (4, random_prompt(9, 10), params, 8)]
    joins = [(k, p, s, parse_tree_budget(b)) for k, p, s, b in cases]
    # Join 0 finishes in step 0's round, while join 2's prefill (4 chunks: its add, then steps 0-2)
    # holds row 2: join 1 moves to row 0, the prefill to row 1. Join 3 (40 tokens: 3 chunks) is
    # added at step 3 and cancelled before step 4 would finish it; join 4 then takes its row.
    tokens, seen = run_batch(chunked.batched(), joins, cancel_at={3: 4})
    for i in (0, 1, 2, 4):
        _, prompt, sampling, budget = cases[i]
        assert tokens[i] == whole.generate(prompt, sampling, tree_budget=budget).token_ids, i
    assert seen[0] == [0] and seen[2][0] == 2 and seen[3] == [] and seen[4][0] == 4


def test_generate_with_several_prompts_some_long(pair):
    """`LLM.generate` with several prompts batches them, long ones a chunk a round."""
    chunked, whole = pair
    prompts = [random_prompt(50, 11), random_prompt(6, 12), random_prompt(33, 13), random_prompt(8, 14)]
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    got = chunked.generate(prompts, params, tree_budget=8)
    assert [r.token_ids for r in got] == [whole.generate(p, params, tree_budget=8).token_ids for p in prompts]


def test_each_chunk_bounds_its_prefix_by_its_start():
    """A chunk's meta serves one eager forward, so its prefix length is its own lower bound: the
    tree attention may take a long prefix through its prefix kernel (`_gluon_prefix`)."""
    chunks = prefill_chunks(10000, 4096, "cpu")
    assert [meta.min_prefix for _, meta, _ in chunks] == [0, 4096, 8192]
    assert [int(meta.prefix_len) for _, meta, _ in chunks[1:]] == [4096, 8192]
