"""At T > 0 DDTree samples exactly the target's distribution (it is lossless).

On a tiny vocabulary the exact distribution of the first three generated tokens is computed from
transformers' logits of the target (every 1- and 2-token continuation of the prompt); thousands
of seeded DDTree generations must match it by a chi-square test. The same test must reject
deliberately wrong acceptance rules, which shows it has the power to see a lossy engine.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.tree import Walk, walk
from tiny_models import make_drafter, make_hybrid_target, make_target

transformers = pytest.importorskip("transformers")
stats = pytest.importorskip("scipy.stats")


VOCAB = 6
PROMPT = [3, 1, 4, 1, 5]
SAMPLES = 1500
WRONG_SAMPLES = 500


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    target, draft = root / "target", root / "drafter"
    make_target(target, "qwen3", vocab=VOCAB, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16,
                intermediate=64, peak=3.0, eos=None)
    make_drafter(draft, target, layers=1, block_size=4, mask_token_id=VOCAB - 1, scale=0.3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    llm = LLM(target, draft, device="cpu", dtype="float32", max_model_len=64)
    return hf, llm


def processed(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Reference processing of one row of logits, in float64: temperature, top-k (ties at the
    k-th value kept), top-p (the smallest prefix of the sorted distribution reaching p)."""
    scores = logits.astype(np.float64) / temperature
    if 0 < top_k < len(scores):
        kth = np.sort(scores)[::-1][top_k - 1]
        scores = np.where(scores >= kth, scores, -np.inf)
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = sorted(range(len(probs)), key=lambda t: -probs[t])
        keep, mass = [], 0.0
        for t in order:
            if mass >= top_p:
                break
            keep.append(t)
            mass += probs[t]
        mask = np.zeros(len(probs), dtype=bool)
        mask[keep] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return probs


@torch.no_grad()
def exact_three_token_distribution(hf, temperature: float, top_k: int = 0, top_p: float = 1.0) -> dict[tuple, float]:
    """P(t1, t2, t3 | PROMPT) under the target's processed distribution."""
    prefixes = [()] + [(a,) for a in range(VOCAB)] + list(itertools.product(range(VOCAB), repeat=2))
    probs = {}
    for prefix in prefixes:
        logits = hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double().numpy()
        probs[prefix] = processed(logits, temperature, top_k, top_p)
    dist = {}
    for seq in itertools.product(range(VOCAB), repeat=3):
        p = probs[()][seq[0]] * probs[seq[:1]][seq[1]] * probs[seq[:2]][seq[2]]
        if p > 0:
            dist[seq] = p
    assert abs(sum(dist.values()) - 1.0) < 1e-9
    return dist


def sample_counts(llm: LLM, count: int, budget, params: dict) -> dict[tuple, int]:
    """How often each 3-token continuation comes out of `count` generations seeded 0 .. count-1."""
    counts: dict[tuple, int] = {}
    drafted_accepted = 0
    for seed in range(count):
        result = llm.generate(PROMPT, SamplingParams(max_tokens=3, seed=seed, **params), budget)
        key = tuple(result.token_ids)
        assert len(key) == 3
        counts[key] = counts.get(key, 0) + 1
        drafted_accepted += result.stats.acceptance_lengths[0] >= 2
    # The test is about the tree: most first rounds must accept drafted tokens.
    assert drafted_accepted > count / 3, f"only {drafted_accepted} of {count} first rounds accepted a drafted token"
    return counts


def chi_square_p(counts: dict[tuple, int], dist: dict[tuple, float]) -> float:
    """Pearson chi-square p-value; cells expected below 5 are merged into one."""
    total = sum(counts.values())
    assert all(seq in dist for seq in counts), f"sampled a sequence of probability 0: {set(counts) - set(dist)}"
    big = [seq for seq, p in dist.items() if p * total >= 5]
    small = [seq for seq in dist if seq not in big]
    observed = [counts.get(seq, 0) for seq in big]
    expected = [dist[seq] * total for seq in big]
    if small:
        observed.append(sum(counts.get(seq, 0) for seq in small))
        expected.append(sum(dist[seq] for seq in small) * total)
    assert len(observed) >= 10, f"too few cells ({len(observed)}) for a meaningful test"
    return float(stats.chisquare(observed, expected).pvalue)


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """A hybrid target (Gated DeltaNet + gated attention) on the same tiny vocabulary."""
    root = tmp_path_factory.mktemp("lossless-hybrid")
    target, draft = root / "target", root / "drafter"
    hf = make_hybrid_target(target, vocab=VOCAB, hidden=32, heads=2, kv_heads=1, head_dim=16, linear_key_heads=1,
                            linear_value_heads=2, linear_head_dim=16, intermediate=64, peak=3.0, eos=None)
    make_drafter(draft, target, layers=1, block_size=4, mask_token_id=VOCAB - 1, scale=0.3)
    llm = LLM(target, draft, device="cpu", dtype="float32", max_model_len=64)
    return hf.double(), llm


def test_hybrid_target_first_three_tokens_follow_the_target_at_t1(hybrid_pair):
    """The tree verify of recurrent layers and the commit of the sampled path are lossless too."""
    hf, llm = hybrid_pair
    dist = exact_three_token_distribution(hf, 1.0)
    counts = sample_counts(llm, SAMPLES, 8, dict(temperature=1.0))
    p = chi_square_p(counts, dist)
    assert p > 1e-3, f"hybrid target: the sampled distribution differs from the target's (p = {p:.2e})"


@pytest.mark.parametrize("budget", [8, "chain"])
def test_first_three_tokens_follow_the_target_at_t1(pair, budget):
    hf, llm = pair
    dist = exact_three_token_distribution(hf, 1.0)
    counts = sample_counts(llm, SAMPLES, budget, dict(temperature=1.0))
    p = chi_square_p(counts, dist)
    assert p > 1e-3, f"budget {budget}: the sampled distribution differs from the target's (p = {p:.2e})"


def test_top_k_top_p_processed_distribution(pair):
    hf, llm = pair
    settings = dict(temperature=0.8, top_k=5, top_p=0.9)
    dist = exact_three_token_distribution(hf, **settings)
    counts = sample_counts(llm, SAMPLES, 8, settings)
    p = chi_square_p(counts, dist)
    assert p > 1e-3, f"top-k/top-p: the sampled distribution differs from the target's (p = {p:.2e})"


def accept_first_child(tree, choices: torch.Tensor) -> Walk:
    """Wrong rule: at every node with a child, act as if the target chose its first child."""
    forced = choices.clone()
    for i in range(tree.size - 1, 0, -1):  # last write wins: the lowest-index child
        if bool(tree.valid[i]):
            forced[tree.parents[i]] = tree.tokens[i]
    return walk(tree, forced)


def greedy_match_sampled_bonus(last_logits: list) -> callable:
    """Wrong rule: accept nodes that match the target's argmax, then take the sampled token at
    the last accepted node as the bonus."""

    def rule(tree, choices: torch.Tensor) -> Walk:
        greedy = walk(tree, last_logits[0].argmax(dim=-1))
        last = greedy.order[greedy.length - 1]
        return Walk(greedy.accepted, greedy.order, greedy.length, choices[last])

    return rule


@pytest.mark.parametrize("rule", ["first-child", "greedy-match"])
def test_wrong_acceptance_rule_fails_the_same_test(pair, rule, monkeypatch):
    hf, llm = pair
    if rule == "first-child":
        monkeypatch.setattr(llm.engine, "walk_fn", accept_first_child)
    else:
        import ddtree.engine

        last_logits: list = [None]
        real_choose = ddtree.engine.choose_tokens

        def recording_choose(logits, params, generator):
            last_logits[0] = logits
            return real_choose(logits, params, generator)

        monkeypatch.setattr(ddtree.engine, "choose_tokens", recording_choose)
        monkeypatch.setattr(llm.engine, "walk_fn", greedy_match_sampled_bonus(last_logits))
    dist = exact_three_token_distribution(hf, 1.0)
    counts = sample_counts(llm, WRONG_SAMPLES, 8, dict(temperature=1.0))
    p = chi_square_p(counts, dist)
    assert p < 1e-6, f"the wrong rule '{rule}' was not detected (p = {p:.2e})"


def test_seed_makes_sampling_reproducible(pair):
    _, llm = pair
    for budget in ("ar", "chain", 8):
        runs = [llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=seed), budget).token_ids
                for seed in (5, 5, 6)]
        assert runs[0] == runs[1], f"budget {budget}: the same seed gave different tokens"
    outputs = {tuple(llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=s), 8).token_ids)
               for s in range(10)}
    assert len(outputs) > 1, "different seeds never changed the output"


@pytest.mark.parametrize("settings", [dict(top_k=1), dict(top_p=1e-6), dict(temperature=1e-4)],
                         ids=["top_k=1", "tiny-top_p", "tiny-temperature"])
def test_degenerate_sampling_is_greedy(pair, settings):
    """Sampling settings that leave one token possible reproduce greedy decoding at every budget."""
    _, llm = pair
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=16), "ar").token_ids
    params = dict(temperature=1.0, seed=0)
    params.update(settings)
    for budget in ("ar", "chain", 8):
        assert llm.generate(PROMPT, SamplingParams(max_tokens=16, **params), budget).token_ids == greedy
