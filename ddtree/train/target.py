"""`ddtree train-target`: a byte-level BPE tokenizer and a small causal LM trained on the corpus,
saved as a Hugging Face directory (`AutoModelForCausalLM` / `AutoTokenizer` load it).

The model is transformers' own `Qwen3ForCausalLM` (dense) or, with `--arch qwen3_5`,
`Qwen3_5ForCausalLM` (hybrid; see `architectures`); batches are random windows of `seq_len + 1`
tokens from the concatenated training files (eos between files); the held-out loss is the mean
next-token cross-entropy over fixed windows of the held-out files.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ddtree.config import DDTreeError
from ddtree.train.architectures import build_model, resolve_architecture, shape_fields
from ddtree.train.common import (Checkpoint, LoopSettings, autocast, check_positive, check_resume, command_line,
                                 make_optimizer, resolve_device, seed_everything, step_generator, train_loop)
from ddtree.train.corpus import load_corpus, read_texts
from ddtree.train.tokenizer import (EOS_TOKEN, check_vocab_size, encode_stream, load_hf_tokenizer, save_tokenizer,
                                    train_tokenizer)

SHAPE_FIELDS = ("vocab_size", "hidden_size", "layers", "heads", "kv_heads", "head_dim", "intermediate_size",
                "seq_len", "max_position_embeddings", "tie_embeddings")


def check_args(args: argparse.Namespace) -> None:
    """Every setting, checked before anything is read or written."""
    check_vocab_size(args.vocab_size)
    for name in ("hidden_size", "layers", "heads", "kv_heads", "head_dim", "intermediate_size", "seq_len",
                 "max_position_embeddings", "batch_size", "eval_batches"):
        check_positive(name, getattr(args, name))
    if args.heads % args.kv_heads:
        raise DDTreeError(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}", "heads")
    if args.head_dim % 2:
        raise DDTreeError(f"--head-dim must be even (rotary embeddings), got {args.head_dim}", "head_dim")
    resolve_architecture(args)
    if args.seq_len > args.max_position_embeddings:
        raise DDTreeError(f"--seq-len {args.seq_len} exceeds --max-position-embeddings {args.max_position_embeddings}",
                          "seq_len")
    if args.epochs is not None:
        check_positive("epochs", args.epochs)
        settings = loop_settings(args)
        settings.steps = args.warmup + 1  # the real length is known once the corpus is tokenized
        settings.validate()
    else:
        loop_settings(args).validate()


def resolve_schedule(args: argparse.Namespace, train_tokens: int) -> None:
    """With --epochs, set the schedule's length from the corpus size (warmup capped at a tenth of it)."""
    if args.epochs is None:
        return
    args.steps = max(1, math.ceil(args.epochs * train_tokens / (args.batch_size * args.seq_len)))
    args.warmup = min(args.warmup, args.steps // 10)


def loop_settings(args: argparse.Namespace) -> LoopSettings:
    return LoopSettings(steps=args.steps, lr=args.lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
                        weight_decay=args.weight_decay, grad_clip=args.grad_clip, eval_every=args.eval_every,
                        save_every=args.save_every, max_steps=args.max_steps, time_limit=args.time_limit)


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    """Rows stream[s : s + length] for each start s -> [len(starts), length]."""
    return stream[starts[:, None] + torch.arange(length)]


def random_windows(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length + 1, (count,), generator=generator)
    return windows(stream, starts, length)


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of batch [B, T + 1] (float32)."""
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def prepare_tokenizer(args, corpus, checkpoint: Checkpoint, resuming: bool):
    """Train the tokenizer (or, when resuming, reload the one the run trained) -> (hf tokenizer, train texts)."""
    texts = read_texts(corpus.train_files)
    folder = checkpoint.folder / "tokenizer"
    if resuming:
        return load_hf_tokenizer(folder), texts
    return train_tokenizer(texts, args.vocab_size, folder), texts


def train_target(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    check_args(args)
    device = resolve_device(args.device)
    out = Path(args.out)
    checkpoint = Checkpoint.for_output(out, args.checkpoint_dir)
    resume_state = checkpoint.load() if args.resume else None
    corpus = load_corpus(args.corpus, args.held_out_fraction)
    seed_everything(args.seed)

    tokenizer, texts = prepare_tokenizer(args, corpus, checkpoint, resume_state is not None)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    train_stream = encode_stream(tokenizer, texts, eos_id)
    held_out_stream = encode_stream(tokenizer, read_texts(corpus.held_out_files), eos_id)
    length = args.seq_len + 1
    for name, stream in (("training", train_stream), ("held-out", held_out_stream)):
        if stream.numel() < length:
            raise DDTreeError(f"the {name} files hold {stream.numel()} tokens, fewer than --seq-len + 1 = {length}",
                              "seq_len")

    resolve_schedule(args, train_stream.numel())
    run_config = {**{k: getattr(args, k) for k in (*SHAPE_FIELDS, *shape_fields(args))}, **loop_settings(args).schedule(),
                  "batch_size": args.batch_size, "seed": args.seed, "held_out_fraction": args.held_out_fraction,
                  "epochs": args.epochs, "corpus": [str(Path(c).resolve()) for c in args.corpus or []]}
    if resume_state is not None:
        check_resume(resume_state, run_config)

    epochs = args.steps * args.batch_size * args.seq_len / train_stream.numel()
    model = build_model(args, eos_id).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    settings = loop_settings(args)
    optimizer = make_optimizer(model, settings, device)
    forward = torch.compile(model) if args.compile else model
    eval_batches = [random_windows(held_out_stream, args.batch_size, length, step_generator(args.seed + 7919, i))
                    for i in range(args.eval_batches)]

    def train_step(step: int):
        batch = random_windows(train_stream, args.batch_size, length, step_generator(args.seed, step)).to(device)
        with autocast(device):
            return lm_loss(forward, batch), batch.numel()

    def evaluate() -> dict:
        total = 0.0
        for batch in eval_batches:  # eager: a compiled model would recompile for eval mode
            with autocast(device):
                total += lm_loss(model, batch.to(device)).item()
        return {"held_out_loss": total / len(eval_batches)}

    print(f"[train-target] {corpus.describe()}; {train_stream.numel():,} train / {held_out_stream.numel():,} "
          f"held-out tokens; {n_params / 1e6:.2f} M parameters on {device}; {args.steps} steps of "
          f"{args.batch_size} x {args.seq_len} tokens ({epochs:.1f} epochs)", flush=True)
    result = train_loop(model, optimizer, settings, train_step, evaluate, checkpoint, run_config, started,
                        resume_state, "train-target")
    summary = {
        "command": command_line(args),
        "kind": "target",
        "arch": args.arch,
        "corpus": corpus.describe(),
        "corpus_roots": [str(r) for r in corpus.roots],
        "held_out_fraction": corpus.held_out_fraction,
        "held_out_files": len(corpus.held_out_files),
        "train_tokens": train_stream.numel(),
        "held_out_tokens": held_out_stream.numel(),
        "parameters": n_params,
        "steps": result.step,
        "schedule_steps": args.steps,
        "epochs": round(epochs, 2),
        "completed": result.completed,
        "stopped_by": result.stopped_by,
        "tokens_seen": result.step * args.batch_size * args.seq_len,
        "held_out_loss": result.last_eval.get("held_out_loss"),
        "eval_history": result.history,
        "train_seconds": round(result.train_seconds, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "seed": args.seed,
    }
    save_target(model, tokenizer, out, args.save_dtype, summary)
    print(f"[train-target] wrote {out} (step {result.step}/{args.steps}, held-out loss "
          f"{summary['held_out_loss']:.4f}, stopped by {result.stopped_by})", flush=True)
    return summary


def save_target(model, tokenizer, out: Path, dtype: str, summary: dict) -> None:
    """A Hugging Face directory: config, weights, tokenizer, generation_config (eos), training.json."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    eos = model.config.eos_token_id
    model = model.to(dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=eos, bos_token_id=None)
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tokenizer, out)
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
