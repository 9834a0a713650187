"""`OutputBuilder`'s incremental text: after every step it equals the decode of every output token
so far, as the whole decode each step gave it, for a byte-level BPE tokenizer (the demo pair's:
random ids split multi-byte characters, so the text often ends in an incomplete one) and a
SentencePiece-style one (a slice's first token loses its leading space), with special tokens
skipped, steps of 1-6 tokens, and stop strings. And it decodes only a few tokens a step."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as RawTokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ddtree.config import SamplingParams
from ddtree.models.tokenizer import Tokenizer, load_tokenizer
from ddtree.output import OutputBuilder

CORPUS = ["def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)", "Grüße aus Köln — naïve café",
          "数学と言語モデル", "emoji 🙂🚀 and more text", "The quick brown fox jumps over the lazy dog."] * 20


def sentencepiece_style() -> Tokenizer:
    raw = RawTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                  initial_alphabet=[f"<0x{b:02X}>" for b in range(256)])
    raw.train_from_iterator(CORPUS, trainer)
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="</s>", unk_token="<unk>",
                                             clean_up_tokenization_spaces=False))


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request):
    if request.param == "byte_level":
        return load_tokenizer("models/demo-target")
    return sentencepiece_style()


def outputs(tokenizer: Tokenizer, seed: int) -> list[int]:
    """Token ids of real text, and of random ids (broken multi-byte characters, special tokens)."""
    gen = random.Random(seed)
    if seed % 2 == 0:
        return tokenizer.encode(" ".join(gen.sample(CORPUS[:5], 5)))
    vocab = len(tokenizer.hf)
    return [gen.randrange(vocab) for _ in range(60)]


@pytest.mark.parametrize("seed", range(8))
def test_text_equals_the_whole_decode_after_every_step(tokenizer, seed):
    ids = outputs(tokenizer, seed)
    out = OutputBuilder(SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True), [], tokenizer.decode_for_output)
    gen = random.Random(seed)
    at, deltas = 0, ""
    while at < len(ids):
        step = ids[at:at + gen.randint(1, 6)]
        at += len(out.add(step))
        assert out.text == tokenizer.decode_for_output(ids[:at]), at
        deltas += out.text_delta()
    out.finish_reason = "length"
    deltas += out.text_delta()
    assert deltas == out.text == tokenizer.decode_for_output(ids)


@pytest.mark.parametrize("seed", [0, 2, 4])
def test_stop_strings_stop_where_the_whole_decode_does(tokenizer, seed):
    ids = outputs(tokenizer, seed)
    full = tokenizer.decode_for_output(ids)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    results = []
    for incremental in (True, False):
        out = OutputBuilder(SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True, stop=[stop]), [],
                            tokenizer.decode_for_output, incremental)
        at = 0
        while at < len(ids) and not out.finished:
            at += len(out.add(ids[at:at + 3]))
        results.append((out.token_ids, out.text, out.finish_reason))
    assert results[0] == results[1] and results[0][2] == "stop"


def test_each_step_decodes_a_few_tokens(tokenizer):
    ids = outputs(tokenizer, 0) * 4
    seen = []

    def decode(token_ids):
        seen.append(len(token_ids))
        return tokenizer.decode_for_output(token_ids)

    out = OutputBuilder(SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True), [], decode)
    for at in range(0, len(ids), 4):
        out.add(ids[at:at + 4])
    assert out.text == tokenizer.decode_for_output(ids)
    assert len(ids) >= 160 and max(seen) <= 32  # two steps' tokens, a few more past incomplete characters


def test_tokenizers_that_clean_up_spaces_decode_whole():
    tok = sentencepiece_style()
    assert tok.decodes_incrementally
    tok.hf.clean_up_tokenization_spaces = True
    assert not tok.decodes_incrementally


def test_output_text_benchmark_times_both_modes(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "text.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.output_text", str(out), "--tokens", "64,200"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [64, 200]
    assert all(r[mode]["request_ms"] > 0 for r in rows for mode in ("whole", "incremental"))


@pytest.mark.parametrize("seed", range(6))
def test_output_decode_equals_transformers_decode(tokenizer, seed):
    """`decode_for_output` calls the Rust tokenizer directly where transformers' decode would only
    wrap it: the text is transformers' own, special tokens skipped, for real text and random ids."""
    ids = outputs(tokenizer, seed) + sorted(tokenizer.special_ids)
    for end in range(0, len(ids) + 1, 7):
        assert tokenizer.decode_for_output(ids[:end]) == tokenizer.hf.decode(ids[:end], skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode():
    hf = sentencepiece_style().hf
    hf.clean_up_tokenization_spaces = True
    calls = []
    decode = hf.decode
    hf.decode = lambda ids, **kw: (calls.append(ids), decode(ids, **kw))[1]
    Tokenizer(hf).decode_for_output([5, 6, 7])
    assert calls == [[5, 6, 7]]
