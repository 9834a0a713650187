"""`ddtree train-target --arch qwen3_5` (a hybrid target: Gated DeltaNet + gated attention):
bad hybrid flags are refused with one line, before anything is written; the dense target stays
the default."""
from __future__ import annotations

import pytest

from train_helpers import run

pytest.importorskip("transformers.models.qwen3_5")


@pytest.mark.parametrize("flags, message", [
    (["--arch", "qwen3_5", "--head-dim", "12"], "--head-dim must be a multiple of 8 with --arch qwen3_5"),
    (["--arch", "qwen3_5", "--linear-key-heads", "3"], "--linear-value-heads 4 must be a multiple of --linear-key-heads 3"),
    (["--arch", "qwen3_5", "--linear-head-dim", "0"], "--linear-head-dim must be > 0"),
    (["--arch", "qwen3_5", "--full-attention-interval", "1"], "--full-attention-interval must be in [2, --layers 4]"),
    (["--arch", "qwen3_5", "--full-attention-interval", "5"], "--full-attention-interval must be in [2, --layers 4]"),
    (["--arch", "qwen3_5", "--conv-kernel", "1"], "--conv-kernel must be >= 2"),
    (["--conv-kernel", "4"], "--conv-kernel applies to --arch qwen3_5 only"),
])
def test_bad_hybrid_flags_are_refused_with_one_line(tmp_path, capsys, flags, message):
    shape = ["--vocab-size", "512", "--hidden-size", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2",
             "--head-dim", "16"]
    if "--arch" in flags:
        shape += ["--linear-key-heads", "2", "--linear-value-heads", "4", "--linear-head-dim", "16"]
    code = run("train-target", "--corpus", tmp_path / "nowhere", "--out", tmp_path / "out", "--checkpoint-dir",
               tmp_path / "ckpt", "--device", "cpu", *shape, *flags)
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "ckpt").exists()


def test_arch_flags_default_to_the_dense_target():
    from ddtree.cli import build_parser

    args = build_parser().parse_args(["train-target", "--out", "x"])
    assert args.arch == "qwen3" and args.linear_key_heads is None and args.full_attention_interval is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train-target", "--out", "x", "--arch", "llama"])

