"""What both trainers share: device and seeds, the cosine schedule, checkpoints that resume the
same run, and the loop with its progress bar, periodic held-out evaluation and stop rules.

A run is deterministic given its settings: the batch of step `s` is drawn from a generator seeded
by `(seed, s)` and the learning rate depends on `s` alone, so resuming from a checkpoint (model,
optimizer, step) replays exactly the steps an uninterrupted run would take.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ddtree.config import DDTreeError


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DDTreeError(f"device must be 'cpu' or 'cuda', got {name!r}", "device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DDTreeError("device 'cuda' was asked for but no CUDA GPU is available", "device")
    if device.type not in ("cpu", "cuda"):
        raise DDTreeError(f"device must be 'cpu' or 'cuda', got {name!r}", "device")
    return device


def command_line(args) -> str:
    """The command that reproduces this run, as the user typed it."""
    return getattr(args, "command_line", None) or "ddtree " + shlex.join(sys.argv[1:])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def step_generator(seed: int, step: int) -> torch.Generator:
    """The CPU generator that draws step `step`'s batch: the same for a fresh and a resumed run."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


def autocast(device: torch.device):
    """bf16 autocast on CUDA; full precision on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def cosine_lr(step: int, total: int, warmup: int, peak: float, floor_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine from `peak` down to `peak * floor_ratio` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor_ratio + (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def check_positive(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise DDTreeError(f"--{name.replace('_', '-')} must be > 0, got {value!r}", name)


@dataclass
class LoopSettings:
    steps: int  # length of the learning-rate schedule: a run is complete at this step
    lr: float
    warmup: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 200
    save_every: int = 500
    log_every: int = 10
    max_steps: int | None = None  # stop this invocation at this step (the run resumes later)
    time_limit: float | None = None  # stop this invocation after this many seconds since it started

    def validate(self) -> None:
        for name in ("steps", "lr", "eval_every", "save_every", "log_every"):
            check_positive(name, getattr(self, name))
        check_positive("max_steps", self.max_steps, allow_none=True)
        check_positive("time_limit", self.time_limit, allow_none=True)
        if self.warmup < 0 or self.warmup >= self.steps:
            raise DDTreeError(f"--warmup must be in [0, steps), got {self.warmup}", "warmup")

    def schedule(self) -> dict:
        """The settings that shape the trajectory (a resumed run must match them)."""
        return {k: getattr(self, k) for k in ("steps", "lr", "warmup", "min_lr_ratio", "weight_decay", "grad_clip")}


class Checkpoint:
    """`checkpoint.pt` (model, optimizer, step, settings, eval history) and `log.jsonl` in one folder."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / "checkpoint.pt"
        self.log_path = self.folder / "log.jsonl"

    @classmethod
    def for_output(cls, out: Path, folder: str | None) -> "Checkpoint":
        """`folder`, or runs/<name of the output folder>-checkpoint."""
        return cls(Path(folder) if folder else Path("runs") / f"{Path(out).name}-checkpoint")

    def exists(self) -> bool:
        return self.path.is_file()

    def save(self, state: dict) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.path)

    def load(self) -> dict:
        if not self.exists():
            raise DDTreeError(f"--resume: no checkpoint at {self.path}", "resume")
        return torch.load(self.path, map_location="cpu", weights_only=False)

    def start_log(self, fresh: bool) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if fresh and self.log_path.exists():
            self.log_path.unlink()

    def log(self, records: list[dict]) -> None:
        with self.log_path.open("a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")

    def read_log(self) -> list[dict]:
        if not self.log_path.is_file():
            return []
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.strip()]


def check_resume(state: dict, run_config: dict) -> None:
    """Raise if the checkpoint was written by a run with different settings."""
    saved = state.get("run_config", {})
    diff = sorted(k for k in set(saved) | set(run_config) if saved.get(k) != run_config.get(k))
    if diff:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {run_config.get(k)!r}" for k in diff[:4])
        raise DDTreeError(f"--resume: the checkpoint was written with other settings ({shown}); "
                          "run with the same settings, or without --resume to start afresh", "resume")


@dataclass
class LoopResult:
    step: int
    completed: bool  # the whole schedule ran
    stopped_by: str  # "steps", "max_steps" or "time_limit"
    train_seconds: float
    history: list[dict] = field(default_factory=list)  # eval results, each with its step

    @property
    def last_eval(self) -> dict:
        return self.history[-1] if self.history else {}


def make_optimizer(model: torch.nn.Module, settings: LoopSettings, device: torch.device) -> torch.optim.AdamW:
    """AdamW; norms and biases are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def train_loop(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    settings: LoopSettings,
    train_step: Callable[[int], tuple[torch.Tensor, int]],
    evaluate: Callable[[], dict],
    checkpoint: Checkpoint,
    run_config: dict,
    started: float,
    resume_state: dict | None,
    desc: str,
) -> LoopResult:
    """Run steps until the schedule, `max_steps` or `time_limit` ends it; evaluate every `eval_every`
    steps and at the end; save a checkpoint every `save_every` steps and at the end.

    `train_step(step)` returns the step's loss (a scalar with grad) and its token count.
    `started` is the `time.monotonic()` at which the command started (the time limit counts from it).
    """
    from tqdm.auto import tqdm

    step, history, train_seconds = 0, [], 0.0
    if resume_state is not None:
        model.load_state_dict(resume_state["model"])
        optimizer.load_state_dict(resume_state["optimizer"])
        step, history = resume_state["step"], list(resume_state["history"])
        train_seconds = resume_state.get("train_seconds", 0.0)
    checkpoint.start_log(fresh=resume_state is None)
    stop_at = min(settings.steps, settings.max_steps or settings.steps)

    def save() -> None:
        checkpoint.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                         "history": history, "run_config": run_config, "train_seconds": train_seconds})

    def run_eval() -> None:
        model.eval()
        with torch.no_grad():
            result = {"step": step, **evaluate()}
        model.train()
        result["elapsed"] = round(time.monotonic() - started, 2)
        history.append(result)
        checkpoint.log([{"eval": result}])
        bar.write(f"[{desc}] step {step}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                                         for k, v in result.items() if k not in ("step", "elapsed")))

    bar = tqdm(total=settings.steps, initial=step, desc=desc, dynamic_ncols=True, file=sys.stderr,
               mininterval=0.5 if sys.stderr.isatty() else 10.0)
    model.train()
    pending: list[tuple[int, torch.Tensor, float]] = []
    window_tokens, window_start = 0, time.monotonic()
    stopped_by = "steps" if stop_at == settings.steps else "max_steps"
    last_loss = float("nan")
    while step < stop_at:
        if settings.time_limit is not None and time.monotonic() - started >= settings.time_limit:
            stopped_by = "time_limit"
            break
        tick = time.monotonic()
        lr = cosine_lr(step, settings.steps, settings.warmup, settings.lr, settings.min_lr_ratio)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, tokens = train_step(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if settings.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        pending.append((step, loss.detach(), lr))
        step += 1
        window_tokens += tokens
        bar.update(1)
        flush = step % settings.log_every == 0 or step == stop_at
        if flush:
            losses = torch.stack([p[1] for p in pending]).float().tolist()  # one host sync per log window
            now = time.monotonic()
            rate = window_tokens / max(now - window_start, 1e-9)
            checkpoint.log([{"step": s + 1, "loss": v, "lr": r} for (s, _, r), v in zip(pending, losses)]
                           + [{"step": step, "tokens_per_second": round(rate), "elapsed": round(now - started, 2)}])
            last_loss = sum(losses) / len(losses)
            post = {"loss": f"{last_loss:.3f}", "tok/s": f"{rate:,.0f}", "lr": f"{lr:.2e}"}
            if history:
                key = next(k for k in history[-1] if k not in ("step", "elapsed"))
                post[key] = f"{history[-1][key]:.3f}"
            bar.set_postfix(post, refresh=False)
            pending, window_tokens, window_start = [], 0, now
        train_seconds += time.monotonic() - tick
        if step % settings.eval_every == 0 and step < stop_at:
            run_eval()
        if step % settings.save_every == 0 and step < stop_at:
            save()
    if pending:
        losses = torch.stack([p[1] for p in pending]).float().tolist()
        checkpoint.log([{"step": s + 1, "loss": v, "lr": r} for (s, _, r), v in zip(pending, losses)])
    bar.close()
    if not history or history[-1]["step"] != step:
        run_eval()
    save()
    return LoopResult(step, step >= settings.steps, stopped_by, train_seconds, history)
