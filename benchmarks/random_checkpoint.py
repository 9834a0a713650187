"""Write a random-weight dense target checkpoint at a real model's shape, with the demo tokenizer, so
that the server can be benchmarked end to end (`ddtree serve --target DIR`, HTTP against in-process)
at the size of a model users run, on a machine that cannot download one.

    python -m benchmarks.random_checkpoint OUT_DIR [--shape qwen3-8b] [--vocab 8192] [--device cuda]
        [--layers N] [--hidden H] [--intermediate I] [--agreeing-draft DRAFT_DIR [--draft-layers 5]]

The body is the shape's (Qwen3-8B: 36 layers, hidden 4096, 32 query / 8 KV heads of 128, FFN
12288); the vocabulary is the demo tokenizer's 8192 ids by default (its tokenizer files are copied,
so every generated id decodes), which makes the LM head 0.5% of the weights instead of 7.6%.
Random weights accept no drafted token, so such a target is served without a drafter (`ar`).

`--agreeing-draft DIR` writes instead a pair that always agrees, to time rounds of deep acceptance
at the real shape: a target and a DFlash drafter of its width (`--draft-layers`, z-lab format)
whose every layer still computes at full size but adds nothing to the residual stream (output
projections `o_proj` and `down_proj` zero), whose embeddings all lie near one direction e0 and
whose LM head is zero but for one row, e0 at `AGREED_TOKEN`. Both then predict that token at every
position with probability about 1 (its logit near sqrt(hidden), every other exactly 0), so every
drafted token is accepted: the text is one token repeated, and a round costs what it costs.
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
AGREED_TOKEN = 7  # the id an agreeing pair always predicts (the demo tokenizer decodes it; not an eos)
MASK_TOKEN = 1  # the agreeing drafter's mask id (its embedding lies near e0 like every other)


def write(out: Path, shape: str, vocab: int, device: str, overrides: dict, agreeing: bool = False) -> dict:
    """The target checkpoint (agreeing: made to predict AGREED_TOKEN everywhere, `agree`)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {**SHAPES[shape], **{k: v for k, v in overrides.items() if v is not None}}
    config = Qwen3Config(vocab_size=vocab, tie_word_embeddings=False, eos_token_id=0, pad_token_id=0,
                         bos_token_id=None, **fields)
    start = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    if agreeing:
        agree(model.model.layers, model.model.embed_tokens.weight, model.lm_head.weight)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (DEMO_TARGET / name).is_file():
            shutil.copy(DEMO_TARGET / name, out / name)
    params = sum(p.numel() for p in model.parameters())
    return {"shape": shape, "vocab": vocab, "parameters": params, "seconds": time.perf_counter() - start}


@torch.no_grad()
def agree(layers, embeddings: torch.Tensor, lm_head: torch.Tensor | None) -> None:
    """In place: layers that add nothing to the residual stream, embeddings near e0, and an LM head
    that scores AGREED_TOKEN by the stream's e0 component and every other token 0."""
    for layer in layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    if embeddings is not None:
        embeddings.normal_(0.0, 0.02)
        embeddings[:, 0] = 1.0
    if lm_head is not None:
        lm_head.zero_()
        lm_head[AGREED_TOKEN, 0] = 1.0


def write_agreeing_draft(out: Path, target_dir: Path, layers: int, device: str) -> dict:
    """A DFlash drafter for the agreeing target at `target_dir`: random layers (N(0, 0.02), norms
    1) that add nothing to the stream, so that the target's embeddings and LM head, which it
    borrows, make it draft AGREED_TOKEN at every position."""
    import json
    import tempfile

    from ddtree.models.configs import DrafterConfig
    from ddtree.models.drafter import DFlashDrafter
    from ddtree.train.drafter import drafter_config_dict, init_drafter, save_drafter

    cfg_dict = drafter_config_dict(target_dir, layers, 16, MASK_TOKEN, None)
    with tempfile.TemporaryDirectory() as folder:  # read back as the engine will read it
        (Path(folder) / "config.json").write_text(json.dumps(cfg_dict))
        cfg = DrafterConfig.from_dir(folder)
    torch.manual_seed(1)
    with torch.device(device):
        drafter = DFlashDrafter(cfg, 64)
    init_drafter(drafter, None, False)
    agree(drafter.layers, None, None)
    save_drafter(drafter, cfg_dict, out, "bfloat16", {"agreeing": True, "agreed_token": AGREED_TOKEN})
    return {"draft_layers": layers, "draft_parameters": sum(p.numel() for p in drafter.parameters())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (the demo tokenizer's: 8192)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=None, dest="num_hidden_layers")
    p.add_argument("--hidden", type=int, default=None, dest="hidden_size")
    p.add_argument("--intermediate", type=int, default=None, dest="intermediate_size")
    p.add_argument("--agreeing-draft", type=Path, default=None, metavar="DRAFT_DIR",
                   help="also write a drafter there, the pair made to always agree (deep acceptance)")
    p.add_argument("--draft-layers", type=int, default=5, help="the agreeing drafter's layers")
    args = p.parse_args()
    overrides = {k: getattr(args, k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size")}
    agreeing = args.agreeing_draft is not None
    info = write(args.out, args.shape, args.vocab, args.device, overrides, agreeing)
    print(f"wrote {args.out}: {info['parameters'] / 1e9:.2f} B parameters ({info['shape']} body, vocabulary "
          f"{info['vocab']}{', always predicting token %d' % AGREED_TOKEN if agreeing else ''}) in "
          f"{info['seconds']:.1f} s", flush=True)
    if agreeing:
        draft = write_agreeing_draft(args.agreeing_draft, args.out, args.draft_layers, args.device)
        print(f"wrote {args.agreeing_draft}: a {draft['draft_layers']}-layer drafter "
              f"({draft['draft_parameters'] / 1e9:.2f} B parameters) that agrees with it", flush=True)


if __name__ == "__main__":
    main()
