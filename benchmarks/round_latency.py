"""Per-round latency of DDTree at Qwen3-8B or Qwen3.6-27B shape (random bf16 weights) against the
hardware floor.

    python benchmarks/round_latency.py [--shape qwen3-8b|qwen3.6-27b] [--budgets ar,chain,16,...]
                                       [--prompt-len 512] [--rounds 24]

For each budget: median ms per round (host wall time between the engine's yields, graphs on),
and the median of each stage replayed alone as its own CUDA graph: draft, build, verify,
walk+commit. The floor is computed from the measured copy bandwidth and bf16 matmul rate of this
GPU: max(bytes / bandwidth, FLOPs / peak) of the target forward over the tree plus the drafter's
forward. Beside it, `floor_by_kind_ms` takes that maximum for the matmuls (weights, their FLOPs)
and for the attention (KV and recurrent state, attention FLOPs) apart and adds them: the bound
for a forward whose attention and matmuls are separate kernels, where the attention's products
cannot run while the weights stream (at 65 tokens over 32k keys the attention is compute bound
and the matmuls bandwidth bound, so the two floors differ; elsewhere they mostly agree). And
`floor_sustained_ms`: the first floor at the matmul rate kept over 4 s of back-to-back matmuls
(`sustained_matmul_rate`) instead of a short burst's, the rate a compute-bound round repeated meets.

For each prompt length, also the time to first token: the engine's first step (the prefill,
ended by the host reading the first token), timed on a second generate call after an untimed
first one (graph capture, compiled glue), beside the prefill's floor (`prefill_floor`), and the
device memory the prefill allocated at its peak beyond what was allocated before it (activations:
the KV cache is allocated with the engine). A prompt of over 1024 tokens is prefilled in chunks of
`Engine.prefill_chunk` (--prefill-chunk). Writes JSON to benchmarks/results/.
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
from ddtree.config import SamplingParams, parse_tree_budget
from ddtree.engine import PREFILL_CHUNK, Engine
from ddtree.kernels import blaslt
from ddtree.models.drafter import DFlashDrafter
from ddtree.models.hybrid import HybridTarget
from ddtree.models.known_shapes import named_pair
from ddtree.models.target import TargetModel
from ddtree.models.layers import RotaryTable
from ddtree.tree_shape import AR

WARMUP_ROUNDS = 4  # rounds before the timed ones: the allocator and the clocks settle


def random_init(module: torch.nn.Module, device) -> torch.nn.Module:
    module = module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return module


def build_models(device, dtype, draft_layers: int, block: int, max_len: int, shape: str = "qwen3-8b"):
    """Random-weight target and drafter of `shape`, built in `dtype` directly (a 27B model in
    float32 would not fit beside its bf16 copy)."""
    tcfg, dcfg = named_pair(shape, draft_layers, block)
    target_class = HybridTarget if tcfg.hybrid else TargetModel
    positions = max_len + 4096 + 512
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            target, drafter = target_class(tcfg, 1), DFlashDrafter(dcfg, 1)
    finally:
        torch.set_default_dtype(previous)
    target, drafter = random_init(target, device), random_init(drafter, device)
    target.rotary = RotaryTable(tcfg.rope, tcfg.head_dim, positions).to(device)
    drafter.rotary = RotaryTable(dcfg.rope, dcfg.head_dim, positions).to(device)
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


def sustained_matmul_rate(device, seconds: float = 4.0, window: int = 40) -> float:
    """bf16 FLOP/s of the same 8192^3 matmul run back to back for `seconds`: the median over the
    second half of windows of `window` calls (about 55 ms each on an H200). The short burst of
    `measure_ceilings` runs at the clocks a cool GPU starts at; a compute-bound round run again and
    again (256 over 32k) may slow as the board meets its power limit, and this is the rate the matmul
    keeps there."""
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    rates, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(window):
            torch.mm(a, b)
        e.record()
        e.synchronize()  # one window at a time: the loop's clock is the host's
        rates.append(window * 2 * 8192**3 / (s.elapsed_time(e) / 1000))
    return statistics.median(rates[len(rates) // 2:])


def matmul_params(module: torch.nn.Module, skip_embedding: bool) -> int:
    total = 0
    for name, p in module.named_parameters():
        if p.dim() == 2 and not (skip_embedding and "embed_tokens" in name):
            total += p.numel()
    return total


def forward_floor(params: int, tokens: int, kv_bytes_read: float, ceilings: dict, bytes_per_param=2,
                  extra_flops: float = 0.0) -> float:
    by_bytes = (params * bytes_per_param + kv_bytes_read) / ceilings["bandwidth_Bps"]
    by_flops = (2 * params * tokens + extra_flops) / ceilings["bf16_flops"]
    return max(by_bytes, by_flops)


def forward_floor_by_kind(params: int, tokens: int, kv_bytes_read: float, ceilings: dict, bytes_per_param=2,
                          extra_flops: float = 0.0) -> float:
    """`forward_floor` with the matmuls (params: their bytes and 2 x params x tokens FLOPs) and the
    rest (kv_bytes_read, extra_flops: the attention's) each at its own bound, added."""
    return (forward_floor(params, tokens, 0.0, ceilings, bytes_per_param)
            + forward_floor(0, tokens, kv_bytes_read, ceilings, extra_flops=extra_flops))


def prefill_chunk_tokens(engine: Engine, prompt_len: int) -> int:
    """Tokens per forward of the engine's prefill: the whole prompt in one graph up to the longest
    padded length (1024), else chunks of `prefill_chunk`."""
    if engine.prefill_lengths and prompt_len <= engine.prefill_lengths[-1]:
        return prompt_len
    return min(prompt_len, engine.prefill_chunk)


def prefill_floor(prompt_len: int, chunk: int, params: int, head_params: int, kv_written: int, kv_read: int,
                  state_bytes: int, pair_flops: int, ceilings: dict) -> float:
    """Seconds a prefill of `prompt_len` tokens in forwards of `chunk` tokens cannot beat.

    params: matmul parameters every token runs (the target's but its LM head, plus, when the
    drafter's context is written, its projection: fc and every layer's k/v); head_params: the LM
    head, run for the last token only; kv_written / kv_read: KV bytes per token written (target
    and drafter) / read again by a later chunk's attention (target); state_bytes: a hybrid's
    recurrent state, written once; pair_flops: attention FLOPs per (query, key) pair over all
    layers, 4 x head_dim x query heads x attention layers.
    FLOPs: 2 x params x P + 2 x head_params, plus causal attention over P^2 / 2 pairs
    (2 P^2 x head_dim x heads x layers). Not counted: a hybrid's Gated DeltaNet recurrence (a few
    Hv Dk Dv per token and layer: under 1% of Qwen3.6-27B's matmul FLOPs), norms, rotary.
    Bytes: the weights once per chunk (the LM head once), the KV written, the prefix keys each
    chunk reads, the state."""
    starts = range(0, prompt_len, chunk)
    extra_bytes = ((len(starts) - 1) * params + head_params) * 2 + prompt_len * kv_written + sum(starts) * kv_read \
        + state_bytes
    extra_flops = 2 * head_params + pair_flops * prompt_len**2 / 2
    return forward_floor(params, prompt_len, extra_bytes, ceilings, extra_flops=extra_flops)


def time_prefill(engine: Engine, prompt: list[int], params: SamplingParams, budget) -> tuple[float, int]:
    """(ms to the first token of `prompt`, bytes the prefill allocated at its peak beyond what was
    allocated before it): the generate call's first step, the second of two calls (the first
    captures the prefill graph or warms the compiled glue up, untimed)."""
    for _ in range(2):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        gen = engine.generate(prompt, params, budget)
        start = time.perf_counter()
        next(gen)  # ends with the host reading the first token
        elapsed = (time.perf_counter() - start) * 1000
        peak = torch.cuda.max_memory_allocated() - before
        gen.close()
    return elapsed, peak


def time_graph(engine: Engine, fn, reps: int = 20) -> float:
    graph, _ = engine.capture(fn)
    return median_replay_ms(graph, reps)


def stage_times(engine: Engine, budget) -> dict:
    """Replay each stage alone as a CUDA graph at the engine's current state (mid-sequence), in
    round order; walk+commit advances the sequence on every replay, so the sequence ends after it."""
    out = {"draft_ms": 0.0, "build_ms": 0.0}  # "ar" drafts nothing
    out.update({f"{name}_ms": time_graph(engine, phase) for name, phase in engine.round_phases(budget).items()})
    return out


def write_result(args, rows, ceilings, engine, drafter, prompt_lens, prefills):
    """The JSON so far (written after every row, so a run cut short keeps what it measured)."""
    result = {
        "benchmark": "round_latency",
        "command": "python benchmarks/round_latency.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version()},
        "git_revision": git_revision(),
        "ceilings": ceilings,
        "capture_seconds": engine.capture_seconds,
        "shape": (f"{args.shape} target (random bf16), {drafter.config.num_hidden_layers}-layer DFlash drafter, block 16; "
                  "floor: weights + KV (+ recurrent state read and written) bytes, matmul + attention FLOPs, target and drafter"),
        "prompt_lens": prompt_lens,
        "prefill_chunk": engine.prefill_chunk,
        "prefill": prefills,
        "rows": rows,
    }
    if blaslt.ENABLED:
        result["blas_choices"] = blaslt.chosen()
    out = results_path(args.output, "round_latency")
    out.write_text(json.dumps(result, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budgets", default="ar,chain,16,32,64,128,256,512,1024")
    ap.add_argument("--prompt-len", default="512", help="prompt lengths, comma-separated (one model build for all)")
    ap.add_argument("--rounds", type=int, default=24, help=f"rounds timed per row; the first {WARMUP_ROUNDS} are warm-up")
    ap.add_argument("--draft-layers", type=int, default=5)
    ap.add_argument("--shape", choices=["qwen3-8b", "qwen3.6-27b"], default="qwen3-8b")
    ap.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="tokens per forward of a long prefill")
    ap.add_argument("--blas", choices=["cublas", "cublaslt"], default=None,
                    help="the library PyTorch routes the matmuls through (torch.backends.cuda.preferred_blas_library)")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    if args.rounds <= WARMUP_ROUNDS:
        ap.error(f"--rounds must be above {WARMUP_ROUNDS}: the first {WARMUP_ROUNDS} rounds are warm-up, not timed")
    device = torch.device("cuda")
    if args.blas is not None:
        torch.backends.cuda.preferred_blas_library(args.blas)
    torch.manual_seed(0)
    ceilings = measure_ceilings(device)
    prompt_lens = [int(x) for x in args.prompt_len.split(",")]
    max_len = max(2048, max(prompt_lens) + 1024)  # room for the rounds after the prompt
    target, drafter = build_models(device, torch.bfloat16, args.draft_layers, 16, max_len, args.shape)
    engine = Engine(target, drafter, max_model_len=max_len, prefill_chunk=args.prefill_chunk)
    params = SamplingParams(max_tokens=10**6, ignore_eos=True)

    tparams = matmul_params(target, skip_embedding=True)
    dparams = matmul_params(drafter, skip_embedding=True) + target.lm_head.weight.numel()
    tcfg = target.config
    attn_layers = len(tcfg.attention_layers)
    kv_token_bytes = 2 * attn_layers * tcfg.num_key_value_heads * tcfg.head_dim * 2
    # A hybrid's recurrent state is read by every verify and rewritten by every commit (float32).
    state_bytes = 2 * target.new_cache(1, "meta", torch.bfloat16).recurrent.state.numel() * 4 if tcfg.hybrid else 0
    dcfg = drafter.config

    def drafter_attention(context: int) -> tuple[float, float]:
        """(KV bytes read, attention FLOPs) of the drafter's block of 16 over `context` keys: its
        sliding layers read only their window."""
        seen = [min(context, dcfg.sliding_window or context) if kind == "sliding_attention" else context
                for kind in dcfg.layer_types]
        kv = sum(2 * dcfg.num_key_value_heads * dcfg.head_dim * 2 * s for s in seen)
        return kv, sum(4 * 16 * s * dcfg.head_dim * dcfg.num_attention_heads for s in seen)

    # The prefill is timed with the first budget that drafts: its prefill writes the drafter's
    # context (as every budget but ar's does), whose projection and KV its floor counts.
    prefill_budget = next((b for b in map(parse_tree_budget, args.budgets.split(",")) if b.drafts), AR)
    context_params = drafter.fc.weight.numel() + drafter.context_kv[0].numel() if prefill_budget.drafts else 0
    draft_kv_token = 2 * dcfg.num_key_value_heads * dcfg.head_dim * 2 * dcfg.num_hidden_layers if prefill_budget.drafts else 0
    pair_flops = 4 * tcfg.head_dim * tcfg.num_attention_heads * attn_layers
    head_params = target.lm_head.weight.numel()

    rows, prefills, round_floors = [], [], []  # round_floors: each row's floor at given ceilings
    for prompt_len, label in [(p, b) for p in prompt_lens for b in args.budgets.split(",")]:
        if prompt_len not in [row["prompt_len"] for row in prefills]:
            prompt = torch.randint(0, 150000, (prompt_len,)).tolist()
            ttft, peak = time_prefill(engine, prompt, params, prefill_budget)
            chunk = prefill_chunk_tokens(engine, prompt_len)
            floor = prefill_floor(prompt_len, chunk, tparams - head_params + context_params, head_params,
                                  kv_token_bytes + draft_kv_token, kv_token_bytes, state_bytes // 2,  # written once
                                  pair_flops, ceilings) * 1000
            forwards = -(-prompt_len // chunk)
            prefills.append({"prompt_len": prompt_len, "tree_budget": str(prefill_budget), "forwards": forwards,
                             "prefill_ms": ttft, "prefill_floor_ms": floor, "ratio_to_floor": ttft / floor,
                             "prefill_peak_extra_mib": peak / 2**20})
            print(f"{prompt_len:>6} prefill ({forwards} x {chunk} tokens, {prefill_budget})  {ttft:9.2f} ms  "
                  f"floor {floor:8.2f} ms  x{ttft / floor:4.2f}  peak +{peak / 2**20:.0f} MiB", flush=True)
        prompt = torch.randint(0, 150000, (prompt_len,)).tolist()
        budget = parse_tree_budget(label)
        size = budget.nodes(16)
        gen = engine.generate(prompt, params, budget)
        next(gen)  # prefill
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            next(gen)
            times.append((time.perf_counter() - t) * 1000)
        stages = stage_times(engine, budget)
        gen.close()
        context = prompt_len + size
        # Attention FLOPs (q.k and p.v): 4 x queries x context x head_dim x query heads per layer.
        attn_flops = 4 * size * context * tcfg.head_dim * tcfg.num_attention_heads * attn_layers
        draft_kv, draft_attn = drafter_attention(context + 16)

        def round_floor(ceilings, size=size, context=context, drafts=budget.drafts, attn_flops=attn_flops,
                        draft_kv=draft_kv, draft_attn=draft_attn) -> tuple[float, float]:
            """(target, drafter) floors in seconds at these ceilings."""
            return (forward_floor(tparams, size, kv_token_bytes * context + state_bytes, ceilings, extra_flops=attn_flops),
                    forward_floor(dparams, 16, draft_kv, ceilings, extra_flops=draft_attn) if drafts else 0.0)
        round_floors.append(round_floor)
        target_floor, draft_floor = round_floor(ceilings)
        floor_ms = (target_floor + draft_floor) * 1000
        by_kind_ms = 1000 * (forward_floor_by_kind(tparams, size, kv_token_bytes * context + state_bytes, ceilings,
                                                   extra_flops=attn_flops)
                             + (forward_floor_by_kind(dparams, 16, draft_kv, ceilings, extra_flops=draft_attn)
                                if budget.drafts else 0.0))
        median = statistics.median(times[WARMUP_ROUNDS:])
        rows.append({"prompt_len": prompt_len, "tree_budget": label, "tree_nodes": size, "round_ms_median": median,
                     "round_ms_all": times, "floor_ms": floor_ms, "ratio_to_floor": median / floor_ms,
                     "floor_by_kind_ms": by_kind_ms, "ratio_to_floor_by_kind": median / by_kind_ms,
                     "target_floor_ms": target_floor * 1000, "draft_floor_ms": draft_floor * 1000, **stages})
        write_result(args, rows, ceilings, engine, drafter, prompt_lens, prefills)
        print(f"{prompt_len:>6} {label:>6}  round {median:7.2f} ms  floor {floor_ms:6.2f} ms  x{median / floor_ms:4.2f}  "
              f"(by kind {by_kind_ms:6.2f} ms  x{median / by_kind_ms:4.2f})  "
              + "  ".join(f"{k} {v:.2f}" for k, v in stages.items()), flush=True)
    # After the rows, so that they run as they did before this rate was measured.
    ceilings["bf16_flops_sustained"] = sustained_matmul_rate(device)
    sustained = {**ceilings, "bf16_flops": ceilings["bf16_flops_sustained"]}
    for row, round_floor in zip(rows, round_floors):
        row["floor_sustained_ms"] = 1000 * sum(round_floor(sustained))
        row["ratio_to_floor_sustained"] = row["round_ms_median"] / row["floor_sustained_ms"]
        print(f"{row['prompt_len']:>6} {row['tree_budget']:>6}  x{row['ratio_to_floor_sustained']:4.2f} the floor at the "
              f"sustained matmul rate ({row['floor_sustained_ms']:6.2f} ms)")
    out = write_result(args, rows, ceilings, engine, drafter, prompt_lens, prefills)
    print(f"wrote {out}; bandwidth {ceilings['bandwidth_Bps'] / 1e12:.2f} TB/s, bf16 {ceilings['bf16_flops'] / 1e12:.0f} "
          f"TFLOP/s ({ceilings['bf16_flops_sustained'] / 1e12:.0f} sustained)")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
