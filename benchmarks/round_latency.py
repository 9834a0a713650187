"""Per-round latency of DDTree at Qwen3-8B shape (random bf16 weights) against the hardware floor.

    python benchmarks/round_latency.py [--budgets ar,chain,16,...] [--prompt-len 512] [--rounds 24]

For each budget: median ms per round (host wall time between the engine's yields, graphs on),
and the median of each stage replayed alone as its own CUDA graph: draft, build, verify,
walk+commit. The floor is computed from the measured copy bandwidth and bf16 matmul rate of this
GPU: max(bytes / bandwidth, FLOPs / peak) of the target forward over the tree plus the drafter's
forward. Writes JSON to benchmarks/results/.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from ddtree.bench.machine import git_revision, results_path
from ddtree.bench.timing import median_replay_ms
from ddtree.config import AR, SamplingParams, parse_tree_budget
from ddtree.engine import Engine, tree_size
from ddtree.models.configs import DrafterConfig, RopeConfig, TargetConfig, build_target_layer_ids
from ddtree.models.drafter import DFlashDrafter
from ddtree.models.target import TargetModel
from ddtree.models.layers import RotaryTable

QWEN3_8B = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                head_dim=128, intermediate_size=12288, vocab_size=151936, rms_norm_eps=1e-6,
                rope=RopeConfig(theta=1000000.0), max_position_embeddings=40960, qk_norm=True)


def random_init(module: torch.nn.Module, device) -> torch.nn.Module:
    module = module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return module


def build_models(device, dtype, draft_layers: int, block: int, max_len: int):
    tcfg = TargetConfig(**QWEN3_8B, architecture="qwen3")
    dcfg = DrafterConfig(**{**QWEN3_8B, "num_hidden_layers": draft_layers}, block_size=block,
                         num_target_layers=36, target_layer_ids=build_target_layer_ids(36, draft_layers),
                         mask_token_id=151935, layer_types=["full_attention"] * draft_layers)
    positions = max_len + 4096 + 512
    with torch.device("meta"):
        target, drafter = TargetModel(tcfg, 1), DFlashDrafter(dcfg, 1)
    target, drafter = random_init(target, device), random_init(drafter, device)
    target.rotary = RotaryTable(tcfg.rope, 128, positions).to(device)
    drafter.rotary = RotaryTable(dcfg.rope, 128, positions).to(device)
    return target.to(dtype).eval().requires_grad_(False), drafter.to(dtype).eval().requires_grad_(False)


def measure_ceilings(device) -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul FLOP/s, median of 10."""
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)

    def timed(fn, reps=10):
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1000)
        return statistics.median(times)

    t_copy = timed(lambda: dst.copy_(src))
    t_mm = timed(lambda: torch.mm(a, b))
    return {"bandwidth_Bps": 2 * src.numel() / t_copy, "bf16_flops": 2 * 8192**3 / t_mm}


def matmul_params(module: torch.nn.Module, skip_embedding: bool) -> int:
    total = 0
    for name, p in module.named_parameters():
        if p.dim() == 2 and not (skip_embedding and "embed_tokens" in name):
            total += p.numel()
    return total


def forward_floor(params: int, tokens: int, kv_bytes_read: float, ceilings: dict, bytes_per_param=2) -> float:
    by_bytes = (params * bytes_per_param + kv_bytes_read) / ceilings["bandwidth_Bps"]
    by_flops = 2 * params * tokens / ceilings["bf16_flops"]
    return max(by_bytes, by_flops)


def time_graph(engine: Engine, fn, reps: int = 20) -> float:
    graph, _ = engine._capture(fn)
    return median_replay_ms(graph, reps)


def stage_times(engine: Engine, budget) -> dict:
    """Replay each stage alone as a CUDA graph at the engine's current state (mid-sequence).
    Every stage writes only scratch slots past the committed length, so replays are harmless."""
    # The next round may already be in flight: n is at most one round's keep past what the host read.
    kv_len = engine._front_kv_len(budget, engine._host_n + engine.buffers[budget].keep)
    out = {"draft_ms": 0.0, "build_ms": 0.0}
    if budget != AR:
        out["draft_ms"] = time_graph(engine, lambda: engine._draft_logits(engine.root, engine.n, kv_len))
        logits = engine._draft_logits(engine.root, engine.n, kv_len)  # the build's log-softmax counts as build
        out["build_ms"] = time_graph(engine, lambda: engine._build(budget, logits, engine.root))
    out["verify_ms"] = time_graph(engine, lambda: engine._verify(budget, kv_len))
    out["walk_commit_ms"] = time_graph(engine, lambda: engine._back(budget))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budgets", default="ar,chain,16,32,64,128,256,512,1024")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    ceilings = measure_ceilings(device)
    target, drafter = build_models(device, torch.bfloat16, args.draft_layers, 16, 2048)
    engine = Engine(target, drafter, max_model_len=2048)
    prompt = torch.randint(0, 150000, (args.prompt_len,)).tolist()
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)

    tparams = matmul_params(target, skip_embedding=True)
    dparams = matmul_params(drafter, skip_embedding=True) + target.lm_head.weight.numel()
    kv_token_bytes = 2 * 36 * 8 * 128 * 2
    rows = []
    for label in args.budgets.split(","):
        budget = parse_tree_budget(label)
        size = tree_size(budget, 16)
        gen = engine.generate(prompt, params, budget)
        next(gen)  # prefill
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            next(gen)
            times.append((time.perf_counter() - t) * 1000)
        stages = stage_times(engine, budget)
        gen.close()
        target_floor = forward_floor(tparams, size, kv_token_bytes * (args.prompt_len + size), ceilings)
        draft_floor = 0.0 if budget == AR else forward_floor(dparams, 16, 0, ceilings)
        floor_ms = (target_floor + draft_floor) * 1000
        median = statistics.median(times[4:])
        rows.append({"tree_budget": label, "tree_nodes": size, "round_ms_median": median,
                     "round_ms_all": times, "floor_ms": floor_ms, "ratio_to_floor": median / floor_ms,
                     "target_floor_ms": target_floor * 1000, "draft_floor_ms": draft_floor * 1000, **stages})
        print(f"{label:>6}  round {median:7.2f} ms  floor {floor_ms:6.2f} ms  x{median / floor_ms:4.2f}  "
              + "  ".join(f"{k} {v:.2f}" for k, v in stages.items()), flush=True)
    result = {
        "benchmark": "round_latency",
        "command": "python benchmarks/round_latency.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version()},
        "git_revision": git_revision(),
        "ceilings": ceilings,
        "capture_seconds": engine.capture_seconds,
        "shape": "Qwen3-8B target (random bf16), 5-layer DFlash drafter, block 16",
        "prompt_len": args.prompt_len,
        "rows": rows,
    }
    out = results_path(args.output, "round_latency")
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}; bandwidth {ceilings['bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 {ceilings['bf16_flops'] / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
