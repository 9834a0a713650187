"""`ddtree train-target` and `ddtree train-drafter` (also runnable as `python -m ddtree.train.cli`,
which needs only torch, transformers, tokenizers, safetensors and tqdm)."""
from __future__ import annotations

import argparse
import sys

from ddtree.cli_args import run
from ddtree.flags import DEVICE, OneLineErrorParser
from ddtree.heldout import DEFAULT_HELD_OUT_FRACTION
from ddtree.train.architectures import add_architecture_args


def _loop_args(p: argparse.ArgumentParser, steps: int, lr: float, batch: int, eval_every: int,
               epochs: bool = False) -> None:
    g = p.add_argument_group("optimisation and run control")
    g.add_argument("--steps", type=int, default=steps, help=f"length of the cosine schedule (default {steps})")
    if epochs:
        g.add_argument("--epochs", type=float, default=None,
                       help="overrides --steps: the schedule's length in passes over the training tokens (the "
                            "warmup is capped at a tenth of it)")
    g.add_argument("--batch-size", type=int, default=batch, help=f"sequences per step (default {batch})")
    g.add_argument("--lr", type=float, default=lr, help=f"peak AdamW learning rate (default {lr})")
    g.add_argument("--warmup", type=int, default=100, help="linear warmup steps (default 100)")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="final / peak learning rate (default 0.1)")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--grad-clip", type=float, default=1.0)
    g.add_argument("--eval-every", type=int, default=eval_every, help="held-out evaluation period in steps")
    g.add_argument("--save-every", type=int, default=500, help="checkpoint period in steps")
    g.add_argument("--max-steps", type=int, default=None,
                   help="stop this run at this step (checkpoint kept; --resume continues the same schedule)")
    g.add_argument("--time-limit", type=float, default=None,
                   help="stop after this many seconds since the command started (checkpoint kept, outputs written; "
                        "train-drafter's data generation takes about half of it)")
    g.add_argument("--checkpoint-dir", default=None, help="checkpoint folder (default runs/<out name>-checkpoint)")
    g.add_argument("--resume", action="store_true", help="continue the run saved in the checkpoint folder")
    g.add_argument("--device", default=None, type=DEVICE, help="cpu or cuda (default: cuda when available); bf16 autocast on cuda")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights on disk")


def _corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--corpus", action="append", default=None, metavar="DIR",
                   help="folder of .py files (repeatable; default: the running Python's standard library)")
    p.add_argument("--held-out-fraction", type=float, default=DEFAULT_HELD_OUT_FRACTION,
                   help="fraction of files held out for evaluation, chosen by path hash (default 0.02)")


def cmd_train_target(args: argparse.Namespace) -> int:
    from ddtree.train.target import train_target

    train_target(args)
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from ddtree.train.drafter import train_drafter

    train_drafter(args)
    return 0


def register(subparsers) -> None:
    t = subparsers.add_parser("train-target", help="train a BPE tokenizer and a small Qwen3 / Qwen3.5 target on "
                                                   "Python code",
                              description="Train a byte-level BPE tokenizer and a small Qwen3 (dense) or Qwen3.5 "
                                          "(hybrid) causal LM; write a Hugging Face directory.")
    t.add_argument("--out", required=True, help="output folder (Hugging Face format)")
    _corpus_args(t)
    s = t.add_argument_group("tokenizer and model shape")
    s.add_argument("--vocab-size", type=int, default=8192, help="a power of two <= 16384 (default 8192)")
    s.add_argument("--hidden-size", type=int, default=384)
    s.add_argument("--layers", type=int, default=6)
    s.add_argument("--heads", type=int, default=6)
    s.add_argument("--kv-heads", type=int, default=2)
    s.add_argument("--head-dim", type=int, default=64)
    s.add_argument("--intermediate-size", type=int, default=1024)
    s.add_argument("--seq-len", type=int, default=512, help="training window in tokens (default 512)")
    s.add_argument("--max-position-embeddings", type=int, default=2048)
    add_architecture_args(s)
    s.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=True,
                   help="share the embedding and LM head (default on)")
    s.add_argument("--compile", action="store_true", help="torch.compile the model")
    s.add_argument("--eval-batches", type=int, default=8, help="held-out batches per evaluation (default 8)")
    _loop_args(t, steps=2000, lr=2e-3, batch=32, eval_every=250, epochs=True)
    t.set_defaults(func=cmd_train_target)

    d = subparsers.add_parser("train-drafter", help="train a DFlash drafter for a target (self-distillation)",
                              description="Train a DFlash block-diffusion drafter on the target's own greedy "
                                          "continuations of corpus prompts; write the z-lab format.")
    d.add_argument("--target", required=True, help="target model folder (Hugging Face format, with tokenizer)")
    d.add_argument("--out", required=True, help="output folder (z-lab DFlash format)")
    _corpus_args(d)
    s = d.add_argument_group("drafter and data")
    s.add_argument("--layers", type=int, default=2, help="drafter layers (default 2)")
    s.add_argument("--block-size", type=int, default=16, help="block size b: anchor + b - 1 masks (default 16)")
    s.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")
    s.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's mask token")
    s.add_argument("--init-from-target", action=argparse.BooleanOptionalAction, default=True,
                   help="start drafter layer i as a copy of target layer i (default on)")
    s.add_argument("--prompt-len", type=int, default=64, help="corpus tokens per prompt (default 64)")
    s.add_argument("--gen-len", type=int, default=192, help="greedy tokens generated per prompt (default 192)")
    s.add_argument("--sequences", type=int, default=4096, help="training prompts to continue (default 4096)")
    s.add_argument("--held-out-sequences", type=int, default=64, help="held-out prompts to continue (default 64)")
    s.add_argument("--gen-batch-size", type=int, default=256, help="prompts per generate call (default 256)")
    s.add_argument("--anchors", type=int, default=32, help="anchors (blocks) per sequence per step (default 32)")
    s.add_argument("--loss-decay", type=float, default=7.0, help="weight of the k-th token: exp(-(k-1)/decay)")
    s.add_argument("--attention", default="auto", choices=["auto", "flex", "dense"],
                   help="block-sparse mask kernel: flex_attention (auto on cuda) or dense SDPA (auto on cpu)")
    _loop_args(d, steps=2000, lr=1e-3, batch=32, eval_every=250)
    d.set_defaults(func=cmd_train_drafter)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(prog="ddtree", description="ddtree training commands")
    register(parser.add_subparsers(dest="command", required=True))
    return run(parser, argv)


if __name__ == "__main__":
    sys.exit(main())
