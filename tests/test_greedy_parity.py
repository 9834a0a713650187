"""Greedy DDTree output is token-for-token the target's own greedy output, at every tree budget.

The reference is transformers' `generate` of the target alone. Random drafters accept little, so
the same parity is also run with an oracle drafter that knows the reference continuation (with
deliberate mistakes at some depths): rounds then accept long paths, walk through branch points
and commit many nodes at once, which is what exercises KV compaction and the drafter's context
commit. While the oracle drives the rounds, the real drafter still runs each round and its draft
is checked against z-lab's reference drafter computed from scratch on the committed sequence.
"""
from __future__ import annotations

import pytest
import torch

from ddtree import LLM, SamplingParams
from ddtree.engine import Engine
from tiny_models import make_drafter, make_target, reference_draft_logprobs

transformers = pytest.importorskip("transformers")

BUDGETS = ["ar", "chain", 1, 4, 16, 64, 256]
MAX_TOKENS = 20
BLOCK = 8


class Setup:
    def __init__(self, root, arch: str, block_size: int = BLOCK, **target_kw):
        self.target_dir, self.draft_dir = root / "target", root / "drafter"
        make_target(self.target_dir, arch, **target_kw)
        make_drafter(self.draft_dir, self.target_dir, block_size=block_size)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(self.target_dir, dtype=torch.float32).eval()
        self.hf.generation_config.eos_token_id = None  # the reference ignores eos, as the requests below do
        self.llm = LLM(self.target_dir, self.draft_dir, device="cpu", dtype="float32", max_model_len=128)
        # Prompts padded to the prefill lengths CUDA graphs run at, here eagerly.
        self.padded = LLM(self.target_dir, self.draft_dir, device="cpu", dtype="float32", max_model_len=128,
                          padded_prefill=True)
        self.vocab = self.hf.config.vocab_size

    @torch.no_grad()
    def reference(self, prompt: list[int], max_new: int) -> list[int] | None:
        """transformers' greedy continuation, or None when some step is a near tie (then float
        rounding, not the engine, could decide the token, and the prompt is not used)."""
        ids = torch.tensor([prompt])
        out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                               pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        assert len(tokens) == max_new
        for scores in out.scores:
            top2 = scores[0].topk(2).values
            if float(top2[0] - top2[1]) < 1e-3:
                return None
        return tokens

    def cases(self, count: int, seed: int, max_new: int) -> list[tuple[list[int], list[int]]]:
        """`count` (prompt, reference continuation) pairs: a one-token prompt, a repetitive one,
        then random prompts of 1-30 tokens; prompts whose reference has a near tie are skipped."""
        gen = torch.Generator().manual_seed(seed)
        candidates = [[self.vocab - 2], [0] * 8]
        while len(candidates) < 4 * count:
            length = 1 + int(torch.randint(0, 30, (1,), generator=gen))
            candidates.append(torch.randint(0, self.vocab, (length,), generator=gen).tolist())
        cases = []
        for prompt in candidates:
            expected = self.reference(prompt, max_new)
            if expected is not None:
                cases.append((prompt, expected))
            if len(cases) == count:
                return cases
        raise AssertionError("too many near ties among the reference continuations")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("qwen3"), "qwen3", kv_heads=2)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return Setup(tmp_path_factory.mktemp("llama"), "llama", kv_heads=1, tie=True, seed=3)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """5 tokens and blocks of 4: budget 256 holds more nodes than exist (4 + 16 + 64 = 84), so
    trees carry padding."""
    return Setup(tmp_path_factory.mktemp("tiny"), "qwen3", block_size=4, vocab=5, eos=None)


@pytest.mark.parametrize("model, prompt_count", [("qwen3", 20), ("llama", 6), ("tiny_vocab", 5)])
def test_greedy_equals_transformers_at_every_budget(model, prompt_count, request):
    s: Setup = request.getfixturevalue(model)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for p, (prompt, expected) in enumerate(s.cases(prompt_count, seed=11, max_new=MAX_TOKENS)):
        for budget in BUDGETS:
            result = s.llm.generate(prompt, params, budget)
            assert result.token_ids == expected, f"prompt {p} {prompt}, budget {budget}"
            assert result.finish_reason == "length"
            assert result.prompt_token_ids == prompt
            lengths = result.stats.acceptance_lengths
            assert len(lengths) == result.stats.decode_rounds
            # The prefill gives one token; every round commits its acceptance length.
            assert 1 + sum(lengths[:-1]) < MAX_TOKENS <= 1 + sum(lengths)
            if budget == "ar":
                assert set(lengths) == {1}


def oracle_logprobs(seq: list[int], n: int, depths: int, vocab: int) -> torch.Tensor:
    """Draft log-probs [depths, vocab] peaked on seq[n+1 ..], with at most one deliberate mistake
    per round, at a depth chosen from n: either a wrong token on top with the right one second (a
    branch point that trees recover and a chain does not), or the right token far from the top."""
    gen = torch.Generator().manual_seed(n)
    logits = torch.randn(depths, vocab, generator=gen)
    mistake_depth = int(torch.randint(1, depths + 4, (1,), generator=gen))  # > depths: no mistake
    kind = int(torch.randint(0, 2, (1,), generator=gen))
    for d in range(1, depths + 1):
        correct = seq[n + d] if n + d < len(seq) else 0
        wrong = (correct + 1 + (n + d) % (vocab - 1)) % vocab
        if d != mistake_depth:
            logits[d - 1, correct] += 9.0
        elif kind == 0:
            logits[d - 1, wrong] += 9.0
            logits[d - 1, correct] += 7.0
        else:
            logits[d - 1, wrong] += 9.0
            logits[d - 1, correct] -= 9.0
    return torch.log_softmax(logits, dim=-1)


def install_oracle(monkeypatch, vocab: int, state: dict) -> None:
    """Replace the drafter by `oracle_logprobs` on state["seq"]; the real drafter still runs each
    round (so its context is maintained as usual) and its drafts' log-probs are kept in state["drafts"]."""
    real_draft = Engine._draft_logits

    def oracle(self, root, n, *rest):
        drafted = real_draft(self, root, n, *rest)
        n = int(n)
        seq = state["seq"]
        assert int(root) == seq[n], f"root of the round at n={n} is not the committed sequence's next token"
        state.setdefault("drafts", []).append((n, torch.log_softmax(drafted, dim=-1)))
        # log-probs as the drafter's logits: the build's log-softmax leaves them as they are
        return oracle_logprobs(seq, n, self.block_size - 1, vocab).to(drafted.device)

    monkeypatch.setattr(Engine, "_draft_logits", oracle)


@pytest.mark.parametrize("model, prompt_count", [("qwen3", 20), ("llama", 4)])
def test_greedy_parity_with_oracle_drafter(model, prompt_count, request, monkeypatch):
    s: Setup = request.getfixturevalue(model)
    state: dict = {}
    install_oracle(monkeypatch, s.vocab, state)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for p, (prompt, expected) in enumerate(s.cases(prompt_count, seed=12, max_new=MAX_TOKENS + BLOCK)):
        state["seq"] = prompt + expected
        for budget in BUDGETS[1:]:
            result = s.llm.generate(prompt, params, budget)
            assert result.token_ids == expected[:MAX_TOKENS], f"prompt {p} {prompt}, budget {budget}"
            if budget in ("chain", 16, 64, 256):
                mean = result.stats.mean_acceptance_length
                assert mean > 3, f"oracle acceptance too short: prompt {p}, budget {budget}, {result.stats}"
            assert max(result.stats.acceptance_lengths) <= (2 if budget == 1 else BLOCK)


def test_padded_prefill_equals_transformers(qwen3):
    """A prompt padded to its prefill length gives the same tokens: the padding's keys and values
    (slots past the prompt) are never seen. The padding holds the previous prompts' tokens."""
    s = qwen3
    assert s.padded.engine.prefill_lengths[:3] == [16, 24, 32]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for p, (prompt, expected) in enumerate(s.cases(8, seed=14, max_new=MAX_TOKENS)):
        for budget in BUDGETS:
            assert s.padded.generate(prompt, params, budget).token_ids == expected, f"prompt {p}, budget {budget}"


@pytest.mark.parametrize("padded", [False, True])
def test_drafter_context_after_long_commits(qwen3, monkeypatch, padded):
    """After rounds that commit up to a whole block at once, the real drafter's draft equals
    z-lab's reference drafter run from scratch on the committed sequence (also after a padded
    prefill, whose padding writes drafter context slots past the prompt)."""
    dflash_model = pytest.importorskip("dflash.model")
    s = qwen3
    llm = s.padded if padded else s.llm
    ref_drafter = dflash_model.DFlashDraftModel.from_pretrained(str(s.draft_dir), dtype=torch.float32).eval()
    state: dict = {}
    install_oracle(monkeypatch, s.vocab, state)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, expected in s.cases(3, seed=13, max_new=MAX_TOKENS + BLOCK):
        state["seq"] = prompt + expected
        for budget in ("chain", 64):
            state["drafts"] = []
            result = llm.generate(prompt, params, budget)
            assert result.token_ids == expected[:MAX_TOKENS]
            assert max(result.stats.acceptance_lengths) > 3
            for n, logp in state["drafts"]:
                ref = reference_draft_logprobs(s.hf, ref_drafter, state["seq"], n)
                assert (logp - ref).abs().max() < 1e-4, f"drafter context wrong at n={n}, budget {budget}"


def test_acceptance_reaches_depth_and_branches(qwen3, monkeypatch):
    """With the oracle, trees accept through a branch point (a wrong top token at some depth)
    where the chain stops: the tree's mean acceptance is strictly higher."""
    s = qwen3
    state: dict = {}
    install_oracle(monkeypatch, s.vocab, state)
    prompt = [3, 14, 15, 92, 65]
    expected = s.reference(prompt, 64 + BLOCK)
    assert expected is not None
    state["seq"] = prompt + expected
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    chain = s.llm.generate(prompt, params, "chain")
    tree = s.llm.generate(prompt, params, 64)
    assert chain.token_ids == tree.token_ids == expected[:64]
    assert BLOCK in tree.stats.acceptance_lengths, "some round accepts the whole block"
    assert tree.stats.mean_acceptance_length > chain.stats.mean_acceptance_length


def test_yarn_target_past_its_max_position_embeddings_equals_transformers(tmp_path):
    """A YaRN-scaled target (max_position_embeddings 48, factor 4: a context limit of 192) decodes
    prompts of 70-90 tokens, past 48, token for token as transformers' greedy decoding does, at
    every budget."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 48}
    s = Setup(tmp_path, "qwen3", kv_heads=2, max_positions=48, rope_scaling=yarn, seed=5)
    assert s.llm.target.config.context_limit == 192
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    gen = torch.Generator().manual_seed(7)
    checked = 0
    for length in (70, 80, 90, 85):
        prompt = torch.randint(0, s.vocab, (length,), generator=gen).tolist()
        expected = s.reference(prompt, MAX_TOKENS)
        if expected is None:
            continue  # a near tie: float rounding could decide it
        checked += 1
        for budget in BUDGETS:
            assert s.llm.generate(prompt, params, budget).token_ids == expected, f"prompt of {length}, budget {budget}"
    assert checked >= 2
