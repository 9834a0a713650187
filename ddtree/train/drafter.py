"""`ddtree train-drafter`: the DFlash recipe for any target the engine loads.

Data (self-distillation): random windows of `prompt_len` corpus tokens, continued greedily by the
target for `gen_len` tokens (batched `generate`). Each training sequence gets `anchors` random anchor
positions p in the continuation; the drafter sees block `[token p, MASK x (b - 1)]` at positions
p .. p + b - 1 and must predict tokens p + 1 .. p + b - 1 (cross-entropy weighted exp(-(k - 1) / decay)
for the k-th future token). Its context is the target's features at `target_layer_ids` for positions
< p, exactly as at inference, where the block's first token is the bonus token at the committed length.

All anchors of a batch go through one forward: the keys are [context (T) | all blocks (A * b)] and a
block-sparse mask lets block j's queries see context keys < anchor_j and block j's own keys only
(flex_attention with a BlockMask on CUDA, the same mask dense through SDPA elsewhere). The drafter is
the engine's `DFlashDrafter`; weights are saved in the z-lab format.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ddtree.config import DDTreeError
from ddtree.models.configs import DrafterConfig, TargetConfig, build_target_layer_ids, read_json
from ddtree.models.drafter import DFlashDrafter
from ddtree.models.layers import apply_rope
from ddtree.train.common import (Checkpoint, LoopSettings, autocast, check_positive, check_resume, command_line,
                                 make_optimizer, resolve_device, seed_everything, step_generator, train_loop)
from ddtree.train.corpus import load_corpus, read_texts
from ddtree.train.target import random_windows
from ddtree.train.target_layers import drafter_init_layers
from ddtree.train.tokenizer import encode_stream, load_hf_tokenizer, mask_token_id

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


# -- the drafter's config and weights in the z-lab format --------------------------------------

def drafter_config_dict(target_dir: Path, layers: int, block_size: int, mask_id: int,
                        intermediate_size: int | None) -> dict:
    """z-lab `config.json` for a drafter of `layers` layers mirroring the target's attention shape."""
    tcfg = read_json(target_dir / "config.json", f"target model {target_dir}")
    target = TargetConfig.from_dir(target_dir)
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target.hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "vocab_size": target.vocab_size,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope.theta,
        "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "layer_types": ["full_attention"] * layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "block_size": block_size,
        "num_target_layers": target.num_hidden_layers,
        "dflash_config": {"target_layer_ids": build_target_layer_ids(target.num_hidden_layers, layers),
                          "mask_token_id": mask_id},
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    for key in ("rope_scaling", "rope_parameters"):
        if tcfg.get(key) and not target.hybrid:  # a hybrid's drafter rotates whole heads, as Qwen3 does
            cfg[key] = tcfg[key]
    return cfg


def zlab_state_dict(drafter: DFlashDrafter, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Our weights under z-lab names: the fused `gate_up_proj` split into `gate_proj` and `up_proj`."""
    out = {}
    inter = drafter.config.intermediate_size
    for name, tensor in drafter.state_dict().items():
        tensor = tensor.detach().to("cpu", dtype).contiguous()
        if ".mlp.gate_up_proj." in name:
            gate, up = tensor.split(inter, dim=0)
            out[name.replace("gate_up_proj", "gate_proj")] = gate.contiguous()
            out[name.replace("gate_up_proj", "up_proj")] = up.contiguous()
        else:
            out[name] = tensor
    return out


def init_drafter(drafter: DFlashDrafter, target_hf, from_target: bool) -> None:
    """Linear weights ~ N(0, 0.02), norms 1; with `from_target`, drafter layer i starts as a copy of
    target layer i (the shapes match: the drafter mirrors the target's attention and MLP); for a
    hybrid target, of its i-th full-attention layer (`target_layers`)."""
    with torch.no_grad():
        for module in drafter.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, 0.02)
                if module.bias is not None:
                    module.bias.zero_()
        if not from_target:
            return
        for mine, src in zip(drafter.layers, drafter_init_layers(target_hf)):
            dst = dict(mine.named_parameters())
            for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                         "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                         "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
                if name in src and src[name].shape == dst[name].shape:
                    dst[name].copy_(src[name])
            gate, up = src.get("mlp.gate_proj.weight"), src.get("mlp.up_proj.weight")
            fused = torch.cat([gate, up]) if gate is not None and up is not None else None
            if fused is not None and fused.shape == dst["mlp.gate_up_proj.weight"].shape:
                dst["mlp.gate_up_proj.weight"].copy_(fused)


# -- the many-anchor training forward ------------------------------------------------------------

def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """anchors [B, A] -> positions of every block token [B, A * b] (anchor + 0 .. b - 1)."""
    return (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).flatten(1)


def block_visibility(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Dense mask [B, A * b, T + A * b]: query of block j sees context keys < anchor_j and block j's keys."""
    num_blocks = anchors.shape[1]
    q_block = torch.arange(num_blocks * block_size, device=anchors.device) // block_size
    context = torch.arange(context_len, device=anchors.device)[None, None, :] < anchors[:, q_block][:, :, None]
    own = (q_block[:, None] == q_block[None, :]).expand(anchors.shape[0], -1, -1)
    return torch.cat([context, own], dim=-1)


def dense_attention(anchors: torch.Tensor, context_len: int, block_size: int) -> AttentionFn:
    """SDPA with the dense block mask: works on any device."""
    mask = block_visibility(anchors, context_len, block_size)[:, None]

    def attend(q, k, v, scale):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    return attend


_compiled_flex = None


def flex_attention_fn(anchors: torch.Tensor, context_len: int, block_size: int, compiled: bool) -> AttentionFn:
    """flex_attention with a BlockMask built from the same rule (compiled on CUDA)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, num_blocks = anchors.shape
    queries = num_blocks * block_size

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        own_block = (kv_idx - context_len) // block_size == block
        return torch.where(kv_idx < context_len, kv_idx < anchors[b, block], own_block)

    block_mask = create_block_mask(mask_mod, batch, None, queries, context_len + queries, device=anchors.device)
    if compiled and _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    kernel = _compiled_flex if compiled else flex_attention

    def attend(q, k, v, scale):
        return kernel(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    return attend


def training_forward(drafter: DFlashDrafter, features: torch.Tensor, noise: torch.Tensor, anchors: torch.Tensor,
                     attend: AttentionFn) -> torch.Tensor:
    """The drafter over many blocks at once.

    features [B, T, len(taps) * H]: the target's features at every context position;
    noise [B, A * b, H]: embeddings of each block `[token at anchor, MASK x (b - 1)]`;
    anchors [B, A]. Returns the drafter's final hidden states [B, A * b, H].
    """
    batch, context_len, _ = features.shape
    queries = noise.shape[1]
    b = drafter.config.block_size
    ctx = drafter.hidden_norm(drafter.fc(features)).flatten(0, 1)  # [B * T, H]
    ctx_pos = torch.arange(context_len, device=features.device).repeat(batch)
    q_pos = block_positions(anchors, b).flatten()
    cos_c, sin_c = drafter.rotary(ctx_pos, ctx.dtype)
    cos_q, sin_q = drafter.rotary(q_pos, noise.dtype)
    h = noise
    for layer in drafter.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h).flatten(0, 1)  # [B * Q, H]
        q = apply_rope(attn.q_norm(attn.q_proj(x).view(-1, attn.n_heads, attn.head_dim)), cos_q, sin_q)
        k_blk, v_blk = attn.key_value(x, cos_q, sin_q)
        k_ctx, v_ctx = attn.key_value(ctx, cos_c, sin_c)
        dtype = v_blk.dtype
        k = torch.cat([k_ctx.view(batch, context_len, attn.n_kv, -1), k_blk.view(batch, queries, attn.n_kv, -1)], 1)
        v = torch.cat([v_ctx.view(batch, context_len, attn.n_kv, -1), v_blk.view(batch, queries, attn.n_kv, -1)], 1)
        q = q.view(batch, queries, attn.n_heads, -1).transpose(1, 2).to(dtype)
        out = attend(q, k.transpose(1, 2).to(dtype), v.transpose(1, 2).to(dtype), attn.scale)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(batch, queries, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)


def position_weights(block_size: int, decay: float, device) -> torch.Tensor:
    """exp(-(k - 1) / decay) for the k-th future token, k = 1 .. b - 1 -> [b - 1]."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / decay)


# -- self-distillation data ----------------------------------------------------------------------

class FeatureTap:
    """Runs a transformers causal LM and returns the outputs of the layers at `layer_ids`, concatenated."""

    def __init__(self, model, layer_ids: list[int]):
        self.model, self.layer_ids, self.outputs = model, layer_ids, {}
        for i in sorted(set(layer_ids)):
            model.model.layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, inputs, output):
            self.outputs[i] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> features [B, T, len(layer_ids) * H]."""
        self.outputs = {}
        self.model.model(input_ids=tokens, use_cache=False)
        return torch.cat([self.outputs[i] for i in self.layer_ids], dim=-1)


def next_batch_size(batch_size: int, done: int, min_count: int, seconds_per_sequence: float | None,
                    seconds_left: float | None) -> int:
    """How many prompts the next generate call takes; 0 to stop.

    Without a deadline (`seconds_left` None): `batch_size`. With one, the first call takes only
    `min_count` (one training batch) to measure the pace; later calls take what fits in the time
    left at that pace, up to `batch_size`; once `min_count` sequences exist and no time is left, stop.
    """
    if seconds_left is None:
        return batch_size
    if done >= min_count and seconds_left <= 0:
        return 0
    if seconds_per_sequence is None:
        return min(batch_size, min_count)
    fits = int(seconds_left / seconds_per_sequence)
    return max(1, min(batch_size, max(fits, min_count - done)))


@torch.no_grad()
def greedy_continuations(model, prompts: torch.Tensor, gen_len: int, batch_size: int, eos_id: int | None,
                         device: torch.device, deadline: float | None = None,
                         min_count: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """prompts [N, P] -> (sequences [N', P + gen_len] = prompt + the target's greedy continuation,
    valid lengths [N']: positions up to and including the first generated eos). N' = N unless
    `deadline` (a time.monotonic() time) comes first: then generation stops near it, with at least
    `min_count` sequences (`next_batch_size`)."""
    from tqdm.auto import tqdm

    n, p = prompts.shape
    seqs, lengths = [], []
    pad = eos_id if eos_id is not None else 0
    start, pace = 0, None
    with tqdm(total=n, desc="self-distillation data", unit="seq", leave=False) as bar:
        while start < n:
            left = deadline - time.monotonic() if deadline is not None else None
            size = min(next_batch_size(batch_size, start, min(min_count, n), pace, left), n - start)
            if size == 0:
                break
            tick = time.monotonic()
            chunk = prompts[start:start + size].to(device)
            out = model.generate(input_ids=chunk, attention_mask=torch.ones_like(chunk), max_new_tokens=gen_len,
                                 do_sample=False, eos_token_id=eos_id, pad_token_id=pad)
            out = out[:, : p + gen_len].cpu()
            if out.shape[1] < p + gen_len:
                out = torch.cat([out, torch.full((out.shape[0], p + gen_len - out.shape[1]), pad)], dim=1)
            length = torch.full((out.shape[0],), p + gen_len)
            if eos_id is not None:
                hit = out[:, p:] == eos_id
                first = torch.where(hit.any(1), hit.float().argmax(1), torch.full_like(length, gen_len))
                length = torch.minimum(p + first + 1, length)
            seqs.append(out)
            lengths.append(length)
            pace = (time.monotonic() - tick) / size
            start += size
            bar.update(size)
    return torch.cat(seqs), torch.cat(lengths)


def sample_anchors(count: int, num_anchors: int, low: int, high: int, generator: torch.Generator) -> torch.Tensor:
    """`num_anchors` distinct positions in [low, high] for each of `count` rows -> [count, A], sorted."""
    scores = torch.rand(count, high - low + 1, generator=generator)
    return scores.argsort(dim=1)[:, :num_anchors].sort(dim=1).values + low


# -- the trainer ---------------------------------------------------------------------------------

DATA_TIME_SHARE = 0.5  # of --time-limit, about, for generating the self-distillation data
EVAL_ROWS = 8  # held-out sequences per evaluation forward
RUN_FIELDS = ("layers", "block_size", "intermediate_size", "mask_token_id", "init_from_target", "prompt_len",
              "gen_len", "sequences", "held_out_sequences", "anchors", "batch_size", "loss_decay", "seed",
              "held_out_fraction")


def check_args(args: argparse.Namespace) -> None:
    for name in ("layers", "prompt_len", "gen_len", "sequences", "held_out_sequences", "gen_batch_size", "anchors",
                 "batch_size", "loss_decay"):
        check_positive(name, getattr(args, name))
    if isinstance(args.block_size, bool) or not isinstance(args.block_size, int) or args.block_size < 2:
        raise DDTreeError(f"--block-size must be an integer >= 2, got {args.block_size!r}", "block_size")
    room = args.gen_len - args.block_size + 1
    if args.anchors > room:
        raise DDTreeError(f"--anchors {args.anchors} exceeds the {room} anchor positions a continuation of "
                          f"--gen-len {args.gen_len} offers with --block-size {args.block_size}", "anchors")
    if args.attention not in ("auto", "flex", "dense"):
        raise DDTreeError(f"--attention must be auto, flex or dense, got {args.attention!r}", "attention")
    loop_settings(args).validate()


def loop_settings(args: argparse.Namespace) -> LoopSettings:
    return LoopSettings(steps=args.steps, lr=args.lr, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
                        weight_decay=args.weight_decay, grad_clip=args.grad_clip, eval_every=args.eval_every,
                        save_every=args.save_every, max_steps=args.max_steps, time_limit=args.time_limit)


def load_target_hf(target_dir: Path, device: torch.device):
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype)
    except Exception as exc:  # transformers raises many types for unreadable checkpoints
        raise DDTreeError(f"target model {target_dir}: transformers cannot load it: {exc}", "target") from None
    return model.to(device).eval().requires_grad_(False)


class DistillData:
    """Self-distillation sequences [N, T] with valid lengths [N], cached in the checkpoint folder."""

    def __init__(self, tokens: torch.Tensor, lengths: torch.Tensor):
        self.tokens, self.lengths = tokens, lengths

    @classmethod
    def build(cls, model, stream: torch.Tensor, count: int, args, eos_id, device, seed: int,
              deadline: float | None = None, min_count: int = 1) -> "DistillData":
        prompts = random_windows(stream, count, args.prompt_len, torch.Generator().manual_seed(seed))
        return cls(*greedy_continuations(model, prompts, args.gen_len, args.gen_batch_size, eos_id, device, deadline,
                                         min_count))

    @property
    def count(self) -> int:
        return self.tokens.shape[0]


class Batcher:
    """Turns rows of distillation data and their anchors into the tensors of one many-anchor forward."""

    def __init__(self, tap: FeatureTap, embed, cfg: DrafterConfig, args, device):
        self.tap, self.embed, self.cfg, self.args, self.device = tap, embed, cfg, args, device
        self.weights = position_weights(cfg.block_size, args.loss_decay, device)

    def __call__(self, data: DistillData, rows: torch.Tensor, anchors: torch.Tensor):
        """rows [B], anchors [B, A] -> features, noise, anchors, labels [B, A, b - 1], loss weights [B, A, b - 1]
        (zero for labels past the sequence's eos)."""
        b = self.cfg.block_size
        tokens = data.tokens[rows].to(self.device)
        lengths = data.lengths[rows].to(self.device)
        anchors = anchors.to(self.device)
        label_pos = anchors[:, :, None] + torch.arange(1, b, device=self.device)  # [B, A, b - 1]
        labels = tokens.gather(1, label_pos.flatten(1)).view_as(label_pos)
        valid = label_pos < lengths[:, None, None]
        block = torch.full((*anchors.shape, b), self.cfg.mask_token_id, device=self.device)
        block[:, :, 0] = tokens.gather(1, anchors)
        noise = self.embed(block.flatten(1)) * self.cfg.input_embedding_scale
        features = self.tap(tokens)
        return features, noise, anchors, labels, valid.float() * self.weights


def chain_acceptance(leading: torch.Tensor, full: torch.Tensor) -> tuple[int, int]:
    """Replay DFlash's chain decoding over one sequence: leading [A] (correct drafts before the first
    wrong one, for the anchor at each position from the first generated token on), full [A] (the
    block lies before the eos). Rounds start at the first anchor and jump by each round's acceptance
    (bonus counted). Returns (accepted tokens, rounds) -- pooled as the engine reports them."""
    leading, full = leading.tolist(), full.tolist()
    pos = tokens = rounds = 0
    while pos < len(leading) and full[pos]:
        accepted = 1 + leading[pos]
        tokens, rounds, pos = tokens + accepted, rounds + 1, pos + accepted
    return tokens, rounds


def train_drafter(args: argparse.Namespace) -> dict:
    started = time.monotonic()
    check_args(args)
    device = resolve_device(args.device)
    target_dir, out = Path(args.target), Path(args.out)
    target_cfg = TargetConfig.from_dir(target_dir)
    tokenizer = load_hf_tokenizer(target_dir)
    mask_id = args.mask_token_id if args.mask_token_id is not None else mask_token_id(tokenizer)
    if mask_id is None or not 0 <= mask_id < target_cfg.vocab_size:
        raise DDTreeError(f"the target's tokenizer has no mask token: pass --mask-token-id (an id below "
                          f"{target_cfg.vocab_size} the corpus never uses), got {mask_id!r}", "mask_token_id")
    args.mask_token_id = mask_id
    checkpoint = Checkpoint.for_output(out, args.checkpoint_dir)
    run_config = {**{k: getattr(args, k) for k in RUN_FIELDS}, **loop_settings(args).schedule(),
                  "target": str(target_dir.resolve()), "corpus": [str(Path(c).resolve()) for c in args.corpus or []]}
    resume_state = None
    if args.resume:
        resume_state = checkpoint.load()
        check_resume(resume_state, run_config)
    corpus = load_corpus(args.corpus, args.held_out_fraction)
    seed_everything(args.seed)

    cfg_dict = drafter_config_dict(target_dir, args.layers, args.block_size, mask_id, args.intermediate_size)
    with tempfile.TemporaryDirectory() as folder:  # read back exactly as the engine will read it
        (Path(folder) / "config.json").write_text(json.dumps(cfg_dict))
        cfg = DrafterConfig.from_dir(folder)
        cfg.check_against(target_cfg, out)

    target_hf = load_target_hf(target_dir, device)
    eos_ids = target_cfg.eos_token_ids
    eos_id = eos_ids[0] if eos_ids else None
    data_path = checkpoint.folder / "distill.pt"
    if resume_state is not None and data_path.is_file():
        cached = torch.load(data_path, weights_only=True)
        train_data, held_out_data = DistillData(*cached["train"]), DistillData(*cached["held_out"])
    else:
        tick = time.monotonic()
        train_stream = encode_stream(tokenizer, read_texts(corpus.train_files), eos_id or 0)
        held_stream = encode_stream(tokenizer, read_texts(corpus.held_out_files), eos_id or 0)
        for name, stream in (("training", train_stream), ("held-out", held_stream)):
            if stream.numel() < args.prompt_len:
                raise DDTreeError(f"the {name} files hold {stream.numel()} tokens, fewer than --prompt-len "
                                  f"{args.prompt_len}", "prompt_len")
        # Under --time-limit the data may take about DATA_TIME_SHARE of it, so that the run still trains
        # and writes its outputs: generation runs in batches sized to end near the deadline, with at
        # least one evaluation chunk of held-out sequences and one training batch.
        deadline = started + DATA_TIME_SHARE * args.time_limit if args.time_limit is not None else None
        held_out_data = DistillData.build(target_hf, held_stream, args.held_out_sequences, args, eos_id, device,
                                          args.seed + 7919, deadline, min_count=EVAL_ROWS)
        train_data = DistillData.build(target_hf, train_stream, args.sequences, args, eos_id, device, args.seed,
                                       deadline, min_count=args.batch_size)
        checkpoint.folder.mkdir(parents=True, exist_ok=True)
        torch.save({"train": (train_data.tokens, train_data.lengths),
                    "held_out": (held_out_data.tokens, held_out_data.lengths)}, data_path)
        print(f"[train-drafter] self-distillation data: {train_data.count} + {held_out_data.count} sequences of "
              f"{args.prompt_len} + {args.gen_len} tokens in {time.monotonic() - tick:.0f} s", flush=True)
        if train_data.count < args.sequences or held_out_data.count < args.held_out_sequences:
            print(f"[train-drafter] --time-limit {args.time_limit:g}: generated {train_data.count} of "
                  f"{args.sequences} training and {held_out_data.count} of {args.held_out_sequences} held-out "
                  f"sequences (the data may take about {DATA_TIME_SHARE:.0%} of the limit)", flush=True)

    seq_len = args.prompt_len + args.gen_len
    drafter = DFlashDrafter(cfg, seq_len + args.block_size).to(device)
    init_drafter(drafter, target_hf, args.init_from_target)
    n_params = sum(p.numel() for p in drafter.parameters())
    tap = FeatureTap(target_hf, cfg.target_layer_ids)
    lm_head = target_hf.get_output_embeddings()
    batcher = Batcher(tap, target_hf.get_input_embeddings(), cfg, args, device)
    use_flex = args.attention == "flex" or (args.attention == "auto" and device.type == "cuda")
    settings = loop_settings(args)
    optimizer = make_optimizer(drafter, settings, device)

    def attention(anchors):
        if use_flex:
            return flex_attention_fn(anchors, seq_len, cfg.block_size, compiled=device.type == "cuda")
        return dense_attention(anchors, seq_len, cfg.block_size)

    def forward(data: DistillData, rows: torch.Tensor, anchors: torch.Tensor):
        """-> (weighted loss, logits [B, A, b - 1, V], labels, weights)."""
        features, noise, anchors, labels, weights = batcher(data, rows, anchors)
        with autocast(device):
            hidden = training_forward(drafter, features, noise, anchors, attention(anchors))
            hidden = hidden.view(*anchors.shape, cfg.block_size, -1)[:, :, 1:]
            logits = drafter.logits(hidden, lm_head)
        ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view_as(weights)
        return (ce * weights).sum() / weights.sum().clamp_min(1e-6), logits, labels, weights

    def train_step(step: int):
        generator = step_generator(args.seed, step)
        rows = torch.randint(0, train_data.tokens.shape[0], (args.batch_size,), generator=generator)
        anchors = sample_anchors(args.batch_size, args.anchors, args.prompt_len, seq_len - cfg.block_size, generator)
        loss, _, _, _ = forward(train_data, rows, anchors)
        return loss, args.batch_size * args.anchors * args.block_size

    every_anchor = torch.arange(args.prompt_len, seq_len - cfg.block_size + 1)
    eval_rows = max(1, min(args.batch_size, EVAL_ROWS))

    limit = started + args.time_limit if args.time_limit is not None else None

    def evaluate() -> dict:
        """Held-out loss over every anchor of the continuations, and the chain's mean acceptance
        length replayed round by round over them. Past --time-limit, no chunk of rows starts after
        the first: the evaluation covers fewer sequences (`held_out_sequences` says how many)."""
        count = 0
        total_loss, tokens, rounds = 0.0, 0, 0
        for start in range(0, held_out_data.count, eval_rows):
            if count and limit is not None and time.monotonic() >= limit:
                break
            rows = torch.arange(start, min(start + eval_rows, held_out_data.count))
            loss, logits, labels, weights = forward(held_out_data, rows, every_anchor.expand(rows.numel(), -1))
            total_loss += loss.item() * rows.numel()
            count += rows.numel()
            leading = ((logits.argmax(-1) == labels) & (weights > 0)).int().cumprod(-1).sum(-1).cpu()
            full = (weights > 0).all(-1).cpu()  # blocks whose b - 1 labels all lie before the eos
            for i in range(rows.numel()):
                t, r = chain_acceptance(leading[i], full[i])
                tokens, rounds = tokens + t, rounds + r
        return {"held_out_loss": total_loss / count, "held_out_acceptance": tokens / max(rounds, 1),
                "held_out_sequences": count}

    print(f"[train-drafter] {corpus.describe()}; {n_params / 1e6:.2f} M drafter parameters, taps "
          f"{cfg.target_layer_ids}, mask token {mask_id}, {'flex' if use_flex else 'dense'} attention on {device}",
          flush=True)
    result = train_loop(drafter, optimizer, settings, train_step, evaluate, checkpoint, run_config, started,
                        resume_state, "train-drafter")
    summary = {
        "command": command_line(args),
        "kind": "drafter",
        "target": str(target_dir),
        "corpus": corpus.describe(),
        "corpus_roots": [str(r) for r in corpus.roots],
        "held_out_fraction": corpus.held_out_fraction,
        "distill_sequences": train_data.count,
        "distill_tokens": train_data.count * seq_len,
        "parameters": n_params,
        "target_layer_ids": cfg.target_layer_ids,
        "steps": result.step,
        "schedule_steps": args.steps,
        "completed": result.completed,
        "stopped_by": result.stopped_by,
        "held_out_loss": result.last_eval.get("held_out_loss"),
        "held_out_acceptance": result.last_eval.get("held_out_acceptance"),
        "held_out_sequences_evaluated": result.last_eval.get("held_out_sequences"),
        "eval_history": result.history,
        "train_seconds": round(result.train_seconds, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "seed": args.seed,
    }
    save_drafter(drafter, cfg_dict, out, args.save_dtype, summary)
    print(f"[train-drafter] wrote {out} (step {result.step}/{args.steps}, held-out loss "
          f"{summary['held_out_loss']:.4f}, estimated chain acceptance {summary['held_out_acceptance']:.2f})",
          flush=True)
    return summary


def save_drafter(drafter: DFlashDrafter, cfg_dict: dict, out: Path, dtype: str, summary: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg_dict, "torch_dtype": dtype}
    weights = zlab_state_dict(drafter, getattr(torch, dtype))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
