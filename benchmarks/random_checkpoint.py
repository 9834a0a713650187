"""Write a random-weight dense target checkpoint at a real model's shape, with the demo tokenizer, so
that the server can be benchmarked end to end (`ddtree serve --target DIR`, HTTP against in-process)
at the size of a model users run, on a machine that cannot download one.

    python -m benchmarks.random_checkpoint OUT_DIR [--shape qwen3-8b] [--vocab 8192] [--device cuda]
        [--layers N] [--hidden H] [--intermediate I]

The body is the shape's (Qwen3-8B: 36 layers, hidden 4096, 32 query / 8 KV heads of 128, FFN
12288); the vocabulary is the demo tokenizer's 8192 ids by default (its tokenizer files are copied,
so every generated id decodes), which makes the LM head 0.5% of the weights instead of 7.6%.
Random weights accept no drafted token, so such a target is served without a drafter (`ar`).
Weights are drawn as transformers initialises the architecture, in bfloat16, on `--device`, and
saved by `save_pretrained` (sharded safetensors). `--layers`/`--hidden`/`--intermediate` shrink
the body (tests write a tiny one on the CPU).
"""
from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

DEMO_TARGET = Path(__file__).resolve().parents[1] / "models" / "demo-target"
SHAPES = {  # transformers Qwen3Config fields
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
                     rms_norm_eps=1e-6),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write(out: Path, shape: str, vocab: int, device: str, overrides: dict) -> dict:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {**SHAPES[shape], **{k: v for k, v in overrides.items() if v is not None}}
    config = Qwen3Config(vocab_size=vocab, tie_word_embeddings=False, eos_token_id=0, pad_token_id=0,
                         bos_token_id=None, **fields)
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (DEMO_TARGET / name).is_file():
            shutil.copy(DEMO_TARGET / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    return {"shape": shape, "vocab": vocab, "parameters": params, "seconds": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (the demo tokenizer's: 8192)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=None, dest="num_hidden_layers")
    p.add_argument("--hidden", type=int, default=None, dest="hidden_size")
    p.add_argument("--intermediate", type=int, default=None, dest="intermediate_size")
    args = p.parse_args()
    overrides = {k: getattr(args, k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size")}
    info = write(args.out, args.shape, args.vocab, args.device, overrides)
    print(f"wrote {args.out}: {info['parameters'] / 1e9:.2f} B parameters ({info['shape']} body, vocabulary "
          f"{info['vocab']}) in {info['seconds']:.1f} s", flush=True)


if __name__ == "__main__":
    main()
