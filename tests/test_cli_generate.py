"""`ddtree generate`: the JSON output and one-line errors for bad input.

A few cases run the real command in a subprocess (`python -m ddtree.cli` and the `ddtree` entry
point); the full matrix of bad inputs calls `ddtree.cli.main` in-process, where any exception other
than the CLI's own error handling escapes and fails the test (it would be a traceback).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree import LLM, SamplingParams
from ddtree.cli import main
from tiny_models import make_drafter, make_target

STATS_KEYS = {"tree_budget", "decode_rounds", "budget_rounds", "mean_acceptance_length", "acceptance_lengths",
              "tokens_per_second", "time_to_first_token_s"}
TOP_KEYS = {"text", "token_ids", "prompt_token_ids", "finish_reason", "stats"}
MAX_POS = 128


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A good pair plus broken variants, all tiny, no tokenizer."""
    root = tmp_path_factory.mktemp("cli")
    dirs = {name: root / name for name in ("target", "draft", "sharded")}
    make_target(dirs["target"], "qwen3", max_positions=MAX_POS)
    make_drafter(dirs["draft"], dirs["target"])
    make_target(dirs["sharded"], "qwen3", max_positions=MAX_POS, shard=True)

    def variant(name: str, source: str) -> Path:
        dirs[name] = root / name
        shutil.copytree(dirs[source], dirs[name])
        return dirs[name]

    def edit_config(path: Path, **changes) -> None:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(changes)
        (path / "config.json").write_text(json.dumps(cfg))

    small = root / "small-target"
    make_target(small, "qwen3", hidden=32, heads=2, kv_heads=1, intermediate=64, max_positions=MAX_POS)
    dirs["draft-hidden"] = root / "draft-hidden"
    make_drafter(dirs["draft-hidden"], small)
    edit_config(variant("draft-vocab", "draft"), vocab_size=200)
    edit_config(variant("draft-layers", "draft"), num_target_layers=6)
    (variant("no-config", "target") / "config.json").unlink()
    (variant("bad-config", "target") / "config.json").write_text("{not json")
    (variant("no-weights", "target") / "model.safetensors").unlink()
    (variant("corrupt-weights", "target") / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    truncated = variant("truncated-weights", "target") / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:5000])
    (variant("corrupt-draft-weights", "draft") / "model.safetensors").write_bytes(b"not safetensors")
    shard = sorted(variant("missing-shard", "sharded").glob("model-*.safetensors"))[1]
    shard.unlink()
    dirs["missing-shard-name"] = shard.name
    edit_config(variant("shape-mismatch", "target"), intermediate_size=96)
    return dirs


def run_in_process(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def base_args(models, target="target", draft="draft") -> list[str]:
    """target / draft: a name in `models` or a path."""
    t = models[target] if isinstance(target, str) and target in models else target
    d = models[draft] if isinstance(draft, str) and draft in models else draft
    return ["--target", str(t), "--draft", str(d), "--device", "cpu", "--dtype", "float32"]


def assert_one_line_error(code: int, out: str, err: str, *fragments: str) -> None:
    assert code != 0
    assert out == ""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"


# -- output ------------------------------------------------------------------------------------


def test_json_output_in_a_subprocess(models):
    """`python -m ddtree.cli generate --json` prints exactly one JSON object with the documented keys."""
    argv = [sys.executable, "-m", "ddtree.cli", "generate", *base_args(models), "--prompt-token-ids", "3,4,5,6",
            "--max-tokens", "12", "--tree-budget", "16", "--ignore-eos", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    data = json.loads(lines[0])
    assert set(data) == TOP_KEYS and set(data["stats"]) == STATS_KEYS
    assert data["prompt_token_ids"] == [3, 4, 5, 6]
    assert len(data["token_ids"]) == 12 and data["finish_reason"] == "length"
    stats = data["stats"]
    assert stats["tree_budget"] == "16"
    assert len(stats["acceptance_lengths"]) == stats["decode_rounds"]
    assert stats["mean_acceptance_length"] == pytest.approx(sum(stats["acceptance_lengths"]) / stats["decode_rounds"])
    assert 1 + sum(stats["acceptance_lengths"]) >= 12, "the prefill token plus every round's tokens cover the output"
    for key in ("tokens_per_second", "time_to_first_token_s"):
        assert isinstance(stats[key], float) and stats[key] > 0
    llm = LLM(models["target"], models["draft"], device="cpu", dtype="float32")
    expected = llm.generate([3, 4, 5, 6], SamplingParams(max_tokens=12, ignore_eos=True), "ar")
    assert data["token_ids"] == expected.token_ids, "the CLI's greedy output is the target's greedy output"


@pytest.mark.parametrize("budget", ["ar", "chain", "4"])
def test_json_stats_per_budget(models, capsys, budget):
    code, out, err = run_in_process(capsys, *base_args(models), "--prompt-token-ids", "7,8,9", "--max-tokens", "6",
                                    "--tree-budget", budget, "--ignore-eos", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert out.count("\n") == 1 and set(data) == TOP_KEYS
    assert data["stats"]["tree_budget"] == budget
    if budget == "ar":
        assert data["stats"]["mean_acceptance_length"] == 1.0
        assert set(data["stats"]["acceptance_lengths"]) == {1}
    assert all(a >= 1 for a in data["stats"]["acceptance_lengths"])


def test_rope_scaling_flag_reaches_past_the_targets_limit(models, capsys):
    """`--rope-scaling` with YaRN doubles the context limit: a prompt longer than the target's
    max_position_embeddings decodes, with the drafter, at the flag's --max-model-len."""
    prompt = ",".join(str(3 + i % 90) for i in range(MAX_POS + 20))
    code, out, err = run_in_process(capsys, *base_args(models), "--prompt-token-ids", prompt, "--max-tokens", "6",
                                    "--tree-budget", "4", "--ignore-eos", "--json", "--max-model-len", str(2 * MAX_POS),
                                    "--rope-scaling", '{"rope_type": "yarn", "factor": 2.0}')
    assert code == 0, err
    data = json.loads(out)
    assert len(data["token_ids"]) == 6 and len(data["prompt_token_ids"]) == MAX_POS + 20


def test_text_prompt_and_plain_output(demo_pair, capsys):
    target, draft = demo_pair
    code, out, err = run_in_process(capsys, "--target", str(target), "--draft", str(draft), "--device", "cpu",
                                    "--dtype", "float32", "--prompt", "def fib(n):", "--max-tokens", "8",
                                    "--tree-budget", "chain")
    assert code == 0, err
    llm = LLM(target, draft, device="cpu", dtype="float32")
    expected = llm.generate("def fib(n):", SamplingParams(max_tokens=8), "chain")
    assert out in (expected.text, expected.text + "\n"), "stdout holds the text only"
    summary = err.strip().splitlines()
    assert len(summary) == 1 and f"{len(expected.token_ids)} tokens" in summary[0] and "budget=chain" in summary[0]


def test_stop_strings_and_top_k_minus_one(demo_pair, capsys):
    """--stop ends the text just before the string (repeatable); --top-k -1 is off, like 0 (as in the server)."""
    target, draft = demo_pair
    base = ["--target", str(target), "--draft", str(draft), "--device", "cpu", "--prompt", "def fib(n):",
            "--max-tokens", "24", "--ignore-eos", "--tree-budget", "chain", "--json"]
    code, out, err = run_in_process(capsys, *base)
    assert code == 0, err
    full = json.loads(out)["text"]
    assert len(full) > 8
    stop = full[5:8]
    code, out, err = run_in_process(capsys, *base, "--stop", "never in the text", "--stop", stop)
    stopped = json.loads(out)
    assert code == 0 and stopped["finish_reason"] == "stop" and stopped["text"] == full[:full.index(stop)]
    sampled = {}
    for top_k in ("-1", "0"):
        code, out, err = run_in_process(capsys, *base, "--temperature", "0.9", "--seed", "3", "--top-k", top_k)
        assert code == 0, err
        sampled[top_k] = json.loads(out)["token_ids"]
    assert sampled["-1"] == sampled["0"]


# -- bad input ---------------------------------------------------------------------------------

BAD_ARGS = {
    # name: (extra args, target, draft, fragments the one-line error must contain)
    "negative-budget": (["--tree-budget", "-3"], "target", "draft", ["tree budget", "-3"]),
    "zero-budget": (["--tree-budget", "0"], "target", "draft", ["tree budget"]),
    "non-numeric-budget": (["--tree-budget", "lots"], "target", "draft", ["tree budget", "lots"]),
    "fractional-budget": (["--tree-budget", "2.5"], "target", "draft", ["tree budget", "2.5"]),
    "huge-budget": (["--tree-budget", "100000"], "target", "draft", ["tree budget", "100000"]),
    "prompt-over-context": (["--prompt-token-ids", ",".join(["5"] * (MAX_POS + 1))], "target", "draft",
                            ["context limit"]),
    "prompt-plus-max-tokens-over-context": (["--prompt-token-ids", "5,6,7", "--max-tokens", str(MAX_POS)], "target",
                                            "draft", ["context limit", "max_tokens"]),
    "max-model-len-over-target": (["--max-model-len", str(MAX_POS * 2)], "target", "draft", ["max_model_len"]),
    "max-model-len-over-rope-scaling": (["--max-model-len", str(MAX_POS * 2 + 1), "--rope-scaling",
                                         '{"rope_type": "yarn", "factor": 2.0}'], "target", "draft",
                                        ["max_model_len", str(MAX_POS * 2)]),
    "rope-scaling-not-json": (["--rope-scaling", "yarn"], "target", "draft", ["--rope-scaling", "JSON object"]),
    "rope-scaling-without-type": (["--rope-scaling", '{"factor": 4}'], "target", "draft", ["--rope-scaling", "rope_type"]),
    "rope-scaling-unsupported": (["--rope-scaling", '{"rope_type": "dynamic", "factor": 2}'], "target", "draft",
                                 ["dynamic", "not supported"]),
    "negative-max-tokens": (["--max-tokens", "-1"], "target", "draft", ["max_tokens"]),
    "negative-temperature": (["--temperature", "-0.5"], "target", "draft", ["temperature"]),
    "bad-top-p": (["--top-p", "1.5"], "target", "draft", ["top_p"]),
    "token-id-outside-vocab": (["--prompt-token-ids", "3,96"], "target", "draft", ["prompt token ids", "96"]),
    "non-numeric-token-ids": (["--prompt-token-ids", "3,x"], "target", "draft", ["--prompt-token-ids", "3,x"]),
    "text-prompt-without-tokenizer": (["--prompt", "hello"], "target", "draft", ["tokenizer"]),
    "drafter-hidden-size": ([], "target", "draft-hidden", ["hidden_size", "32", "64"]),
    "drafter-vocab": ([], "target", "draft-vocab", ["vocab_size", "200", "96"]),
    "drafter-num-target-layers": ([], "target", "draft-layers", ["num_target_layers", "6", "4"]),
    "drafter-is-a-target": ([], "target", "target", ["DFlashDraftModel"]),
    "missing-config": ([], "no-config", "draft", ["config.json", "missing"]),
    "corrupt-config": ([], "bad-config", "draft", ["config.json", "cannot parse"]),
    "missing-weights": ([], "no-weights", "draft", ["no model.safetensors"]),
    "corrupt-weights": ([], "corrupt-weights", "draft", ["corrupt weight file"]),
    "truncated-weights": ([], "truncated-weights", "draft", ["corrupt weight file"]),
    "corrupt-drafter-weights": ([], "target", "corrupt-draft-weights", ["drafter", "corrupt weight file"]),
    "missing-shard": ([], "missing-shard", "draft", ["missing weight shard"]),
    "weight-shape-mismatch": ([], "shape-mismatch", "draft", ["shape"]),
    "target-not-a-directory": ([], "/nonexistent/target-dir", "draft",
                               ["--target", "/nonexistent/target-dir", "no such directory"]),
    "drafter-not-a-directory": ([], "target", "/nonexistent/draft-dir",
                                ["--draft", "/nonexistent/draft-dir", "no such directory"]),
}


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_input_gives_one_line_error(models, capsys, case):
    extra, target, draft, fragments = BAD_ARGS[case]
    argv = base_args(models, target, draft)
    if not any(a.startswith("--prompt") for a in extra):
        argv += ["--prompt-token-ids", "3,4,5"]
    code, out, err = run_in_process(capsys, *argv, "--max-tokens", "4", *extra)
    if case == "missing-shard":
        fragments = [*fragments, models["missing-shard-name"]]
    assert_one_line_error(code, out, err, *fragments)


def test_cuda_requested_without_gpu(models, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code, out, err = run_in_process(capsys, "--target", str(models["target"]), "--draft", str(models["draft"]),
                                    "--device", "cuda", "--prompt-token-ids", "3")
    assert_one_line_error(code, out, err, "cuda")


def entry_point() -> list[str]:
    script = Path(sys.executable).parent / "ddtree"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("ddtree")
    return [found] if found else [sys.executable, "-m", "ddtree.cli"]


@pytest.mark.parametrize("case", ["corrupt-weights", "non-numeric-budget"])
def test_bad_input_in_a_subprocess(models, case):
    """The installed `ddtree` command: one line on stderr, exit code 2, nothing on stdout."""
    extra, target, draft, fragments = BAD_ARGS[case]
    argv = [*entry_point(), "generate", *base_args(models, target, draft), "--prompt-token-ids", "3,4", *extra]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, *fragments)


# -- corrupt config values -------------------------------------------------------------------------


CORRUPT_CONFIGS = [
    # (id, which model, config changes, fragments)
    ("kv-heads-not-dividing", "target", {"num_key_value_heads": 3}, ["num_key_value_heads"]),
    ("hidden-size-missing", "target", {"hidden_size": None}, ["hidden_size"]),
    ("hidden-size-text", "target", {"hidden_size": "64"}, ["hidden_size"]),
    ("unsupported-architecture", "target", {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
     ["GPT2LMHeadModel", "not supported"]),
    ("unsupported-rope", "target", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     ["dynamic", "yarn"]),
    ("yarn-factor-zero", "target", {"rope_parameters": {"rope_type": "yarn", "factor": 0, "rope_theta": 1e4}},
     ["rope factor"]),
    ("max-positions-text", "target", {"max_position_embeddings": "many"}, ["max_position_embeddings"]),
    ("heads-zero", "target", {"num_attention_heads": 0}, ["num_attention_heads"]),
    ("drafter-not-dflash", "draft", {"architectures": ["Qwen3ForCausalLM"]}, ["DFlashDraftModel"]),
    ("drafter-mask-token-missing", "draft", {"dflash_config": {"target_layer_ids": [1, 1]}}, ["mask_token_id"]),
    ("drafter-mask-token-outside-vocab", "draft", {"dflash_config": {"target_layer_ids": [1, 1], "mask_token_id": 500}},
     ["mask_token_id", "500"]),
    ("drafter-layer-ids-outside-target", "draft", {"dflash_config": {"target_layer_ids": [0, 9], "mask_token_id": 95}},
     ["target_layer_ids", "9"]),
    ("drafter-block-size-one", "draft", {"block_size": 1}, ["block_size"]),
    ("drafter-layer-types-wrong-length", "draft", {"layer_types": ["full_attention"]}, ["layer_types"]),
    ("drafter-block-size-text", "draft", {"block_size": "big"}, ["block_size"]),
    ("drafter-layer-ids-text", "draft", {"dflash_config": {"target_layer_ids": "x", "mask_token_id": 95}},
     ["target_layer_ids"]),
    ("drafter-sliding-window-zero", "draft", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 0},
     ["sliding_window"]),
]


def case_id(case) -> str:
    return case.values[0] if hasattr(case, "values") else case[0]


@pytest.mark.parametrize("name, which, changes, fragments", CORRUPT_CONFIGS, ids=[case_id(c) for c in CORRUPT_CONFIGS])
def test_corrupt_config_values(models, capsys, tmp_path, name, which, changes, fragments):
    broken = tmp_path / which
    shutil.copytree(models[which], broken)
    cfg = json.loads((broken / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (broken / "config.json").write_text(json.dumps(cfg))
    target, draft = (broken, "draft") if which == "target" else ("target", broken)
    code, out, err = run_in_process(capsys, *base_args(models, target, draft), "--prompt-token-ids", "3,4",
                                    "--max-tokens", "4")
    assert_one_line_error(code, out, err, *fragments)
