"""Stop rules through `LLM.generate` / `LLM.stream`: max_tokens, eos (and ignore_eos), stop token
ids, stop strings, the context limit, and streaming deltas that add up to the final text.

Each case runs with a random drafter (rounds accept about one token) and with a perfect oracle
drafter (every round accepts the whole block), so that stops land both at round boundaries and in
the middle of a round, where the tokens after the stop must be dropped.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from ddtree import LLM, DDTreeError, SamplingParams
from ddtree.engine import Engine
from tiny_models import make_pair_with_tokenizer


PROMPT_TEXT = "def fib(n):\n    return"
FULL = 48  # tokens of the unstopped reference run
BLOCK = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair_with_tokenizer(tmp_path_factory.mktemp("stop"), block_size=BLOCK)


@pytest.fixture(scope="module")
def llm(pair):
    return LLM(*pair, device="cpu", dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def full(llm):
    """The unstopped greedy continuation (token ids) of the prompt."""
    prompt = llm.encode(PROMPT_TEXT)
    result = llm.generate(prompt, SamplingParams(max_tokens=FULL + BLOCK, ignore_eos=True), "ar")
    return prompt, result.token_ids


@pytest.fixture(params=["random", "oracle"])
def drafter(request, full, monkeypatch):
    """'oracle': the draft is the reference continuation itself, so each round accepts a whole block."""
    if request.param == "oracle":
        prompt, tokens = full
        seq = prompt + tokens

        def perfect(self, root, n, *rest):
            n = int(n)
            depths = self.block_size - 1
            logp = torch.full((depths, self.target.config.vocab_size), -20.0)
            for d in range(1, depths + 1):
                logp[d - 1, seq[n + d] if n + d < len(seq) else 0] = 0.0
            return logp

        monkeypatch.setattr(Engine, "_draft_logits", perfect)
    return request.param


def decode(llm: LLM, ids: list[int]) -> str:
    return llm.tokenizer.decode_for_output(ids)


def collect_stream(llm: LLM, prompt, params, budget):
    """Run the stream; return (result, concatenated token ids, concatenated text)."""
    ids, text, result = [], "", None
    for event in llm.stream(prompt, params, budget):
        ids += event.token_ids
        text += event.text
        result = event.result
    return result, ids, text


BUDGETS = ["ar", "chain", 16]


@pytest.mark.parametrize("budget", BUDGETS)
def test_max_tokens(llm, full, drafter, budget):
    prompt, tokens = full
    for m in (1, 2, 5, 13, 30):
        result = llm.generate(prompt, SamplingParams(max_tokens=m, ignore_eos=True), budget)
        assert result.token_ids == tokens[:m], f"max_tokens {m}"
        assert result.finish_reason == "length"
        assert result.text == decode(llm, tokens[:m])


def first_index_at_least(tokens: list[int], start: int) -> tuple[int, int]:
    """A token whose first occurrence is at index >= start: (token, index)."""
    for i in range(start, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return tokens[i], i
    raise AssertionError("no token first occurs late enough")


@pytest.mark.parametrize("budget", BUDGETS)
def test_stop_token_ids(llm, full, drafter, budget):
    prompt, tokens = full
    for start in (0, 3, 11):
        stop, i = first_index_at_least(tokens, start)
        for ignore_eos in (False, True):
            params = SamplingParams(max_tokens=FULL, stop_token_ids=[stop], ignore_eos=ignore_eos)
            result, ids, text = collect_stream(llm, prompt, params, budget)
            assert result.token_ids == tokens[: i + 1], "the stop token is the last token"
            assert result.finish_reason == "stop"
            assert result.text == decode(llm, tokens[:i]), "the stop token is not in the text"
            assert ids == result.token_ids and text == result.text


@pytest.fixture(scope="module")
def eos_pair(pair, full, tmp_path_factory):
    """A copy of the target whose generation_config.json makes two tokens of the output eos."""
    _, tokens = full
    target, draft = pair
    copy = tmp_path_factory.mktemp("eos") / "target"
    shutil.copytree(target, copy)
    eos_a, i = first_index_at_least(tokens, 9)
    eos_b, j = first_index_at_least(tokens, i + 3)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos_b, eos_a]}))
    return LLM(copy, draft, device="cpu", dtype="float32", max_model_len=256), i


@pytest.mark.parametrize("budget", BUDGETS)
def test_eos_and_ignore_eos(eos_pair, full, drafter, budget):
    llm, i = eos_pair
    prompt, tokens = full
    result = llm.generate(prompt, SamplingParams(max_tokens=FULL), budget)
    assert result.token_ids == tokens[: i + 1] and result.finish_reason == "stop"
    assert result.text == decode(llm, tokens[:i])
    ignored = llm.generate(prompt, SamplingParams(max_tokens=FULL, ignore_eos=True), budget)
    assert ignored.token_ids == tokens[:FULL] and ignored.finish_reason == "length"


def ascii_stop_strings(llm: LLM, tokens: list[int]) -> list[tuple[str, int]]:
    """Stop strings taken from the reference text, each with the number of tokens whose decoding
    first contains it. Some span a token boundary."""
    text = decode(llm, tokens)
    picked = []
    for k in range(4, len(tokens)):
        before, after = decode(llm, tokens[:k]), decode(llm, tokens[: k + 1])
        if not after.startswith(before) or len(after) - len(before) < 2:
            continue
        boundary = len(before)
        s = text[boundary - 2 : boundary + 2]  # two characters each side of a token boundary
        if len(s) == 4 and s.isascii() and s.isprintable() and s not in decode(llm, tokens[:k]):
            first = next(m for m in range(1, len(tokens) + 1) if s in decode(llm, tokens[:m]))
            picked.append((s, first))
        if len(picked) == 3:
            break
    assert picked, "no usable stop string in the reference text"
    return picked


@pytest.mark.parametrize("budget", BUDGETS)
def test_stop_strings(llm, full, drafter, budget):
    prompt, tokens = full
    for s, k in ascii_stop_strings(llm, tokens[:FULL]):
        params = SamplingParams(max_tokens=FULL, stop=[s], ignore_eos=True)
        result, ids, text = collect_stream(llm, prompt, params, budget)
        expected_text = decode(llm, tokens[:k])
        expected_text = expected_text[: expected_text.find(s)]
        assert result.token_ids == tokens[:k], f"stop {s!r}: ends with the token that completed it"
        assert result.text == expected_text and s not in result.text
        assert result.finish_reason == "stop"
        assert ids == result.token_ids and text == result.text, "stream adds up to the result"


def test_earliest_of_several_stop_strings_wins(llm, full):
    prompt, tokens = full
    (s1, k1), (s2, k2) = ascii_stop_strings(llm, tokens[:FULL])[:2]
    result = llm.generate(prompt, SamplingParams(max_tokens=FULL, stop=[s2, s1], ignore_eos=True), 16)
    assert result.token_ids == tokens[: min(k1, k2)]


@pytest.mark.parametrize("budget", BUDGETS)
def test_stream_deltas_add_up(llm, full, drafter, budget):
    prompt, tokens = full
    result, ids, text = collect_stream(llm, prompt, SamplingParams(max_tokens=FULL, ignore_eos=True), budget)
    assert ids == result.token_ids == tokens[:FULL]
    assert text == result.text == decode(llm, tokens[:FULL])
    if drafter == "oracle" and budget != "ar":
        assert set(result.stats.acceptance_lengths) == {BLOCK}, "the oracle's rounds accept whole blocks"


def test_context_limit_rejected_before_work(pair, full):
    prompt, tokens = full
    limit = len(prompt) + 40
    llm = LLM(*pair, device="cpu", dtype="float32", max_model_len=limit)
    for budget in ("ar", 16):
        with pytest.raises(DDTreeError, match="context limit"):
            llm.generate(prompt, SamplingParams(max_tokens=41, ignore_eos=True), budget)
        with pytest.raises(DDTreeError, match="context limit"):
            next(llm.stream([5] * (limit + 1), SamplingParams(max_tokens=1), budget))
    # The rejected requests changed nothing; a request exactly at the limit still works.
    for budget in ("ar", "chain", 256):
        result = llm.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True), budget)
        assert result.token_ids == tokens[:40]


def test_context_limit_with_long_acceptance_at_the_end(pair, full, drafter):
    """With the oracle every round accepts a whole block right up to the context limit."""
    prompt, tokens = full
    limit = len(prompt) + FULL
    llm = LLM(*pair, device="cpu", dtype="float32", max_model_len=limit)
    for budget in ("chain", 256):
        result = llm.generate(prompt, SamplingParams(max_tokens=FULL, ignore_eos=True), budget)
        assert result.token_ids == tokens[:FULL]
