"""`ddtree train-target` on a tiny corpus: loss falls, a resumed run replays the same steps, the output
is a Hugging Face folder that transformers and the engine load, bad input changes nothing."""
from __future__ import annotations

import json

import pytest
import torch

from train_helpers import evals, losses, run, write_corpus

SHAPE = ["--vocab-size", "512", "--hidden-size", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2",
         "--head-dim", "16", "--intermediate-size", "128", "--seq-len", "64", "--max-position-embeddings", "512"]
LOOP = ["--batch-size", "8", "--steps", "24", "--warmup", "4", "--lr", "3e-3", "--eval-every", "8",
        "--eval-batches", "2", "--held-out-fraction", "0.2", "--device", "cpu", "--save-dtype", "float32"]


def train(tmp, corpus, out, ckpt, *extra):
    return run("train-target", "--corpus", corpus, "--out", tmp / out, "--checkpoint-dir", tmp / ckpt, *SHAPE, *LOOP,
               *extra)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_target")
    corpus = write_corpus(tmp / "corpus")
    assert train(tmp, corpus, "out", "ckpt") == 0
    return tmp, corpus


def test_loss_decreases(trained):
    tmp, _ = trained
    curve = losses(tmp / "ckpt")
    assert sorted(curve) == list(range(1, 25))
    first, last = sum(curve[s] for s in range(1, 5)) / 4, sum(curve[s] for s in range(21, 25)) / 4
    assert last < first - 0.5, (first, last)
    held_out = [e["held_out_loss"] for e in evals(tmp / "ckpt")]
    assert [e["step"] for e in evals(tmp / "ckpt")] == [8, 16, 24]
    assert held_out[-1] < held_out[0]
    summary = json.loads((tmp / "out" / "training.json").read_text())
    assert summary["steps"] == 24 and summary["completed"] and summary["held_out_loss"] == held_out[-1]
    assert summary["command"].startswith("ddtree train-target --corpus")


def test_resume_replays_the_uninterrupted_run(trained):
    tmp, corpus = trained
    assert train(tmp, corpus, "out2", "ckpt2", "--max-steps", "10") == 0
    stopped = json.loads((tmp / "out2" / "training.json").read_text())
    assert stopped["steps"] == 10 and not stopped["completed"] and stopped["stopped_by"] == "max_steps"
    assert train(tmp, corpus, "out2", "ckpt2", "--resume") == 0
    resumed, straight = losses(tmp / "ckpt2"), losses(tmp / "ckpt")
    assert sorted(resumed) == sorted(straight)
    for step in straight:
        assert resumed[step] == pytest.approx(straight[step], rel=1e-5, abs=1e-6), step
    assert json.loads((tmp / "out2" / "training.json").read_text())["steps"] == 24


def test_output_loads_in_transformers_and_the_engine(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ddtree.config import SamplingParams
    from ddtree.llm import LLM

    out = trained[0] / "out"
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.vocab_size == 512
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id == 0
    assert tok.mask_token == "<|mask|>" and tok.chat_template
    ids = torch.tensor([tok.encode("def f(x):\n    return", add_special_tokens=False)])
    hf = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:]
    llm = LLM(out, use_draft=False, device="cpu")
    ours = llm.generate(ids[0].tolist(), SamplingParams(max_tokens=8, ignore_eos=True), tree_budget="ar")
    assert ours.token_ids == hf.tolist()


def test_time_limit_stops_and_still_writes_the_output(trained, tmp_path):
    _, corpus = trained
    assert train(tmp_path, corpus, "out", "ckpt", "--time-limit", "0.001") == 0
    summary = json.loads((tmp_path / "out" / "training.json").read_text())
    assert summary["stopped_by"] == "time_limit" and summary["steps"] == 0 and not summary["completed"]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_epochs_set_the_schedule_from_the_corpus_size(trained, tmp_path):
    _, corpus = trained
    assert train(tmp_path, corpus, "out", "ckpt", "--epochs", "0.01", "--warmup", "100", "--max-steps", "1") == 0
    summary = json.loads((tmp_path / "out" / "training.json").read_text())
    tokens_per_step = 8 * 64
    assert summary["schedule_steps"] == -(-summary["train_tokens"] // (100 * tokens_per_step))
    assert summary["steps"] == 1 and summary["stopped_by"] == "max_steps"


def test_bad_input_is_refused_and_writes_nothing(trained, tmp_path, capsys):
    tmp, corpus = trained
    assert train(tmp_path, corpus, "out", "ckpt", "--vocab-size", "1000") == 2
    assert "power of two" in capsys.readouterr().err
    assert train(tmp_path, corpus, "out", "ckpt", "--seq-len", "1024") == 2
    assert "exceeds --max-position-embeddings" in capsys.readouterr().err
    assert train(tmp_path, tmp_path / "nowhere", "out", "ckpt") == 2
    assert "does not exist" in capsys.readouterr().err
    assert train(tmp_path, corpus, "out", "ckpt", "--epochs", "-1") == 2
    assert "--epochs must be > 0" in capsys.readouterr().err
    assert train(tmp_path, corpus, "out", "ckpt", "--resume") == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()
    before = (tmp / "ckpt" / "checkpoint.pt").stat().st_mtime_ns
    assert train(tmp, corpus, "out", "ckpt", "--resume", "--lr", "1e-3") == 2
    assert "other settings" in capsys.readouterr().err
    assert (tmp / "ckpt" / "checkpoint.pt").stat().st_mtime_ns == before
