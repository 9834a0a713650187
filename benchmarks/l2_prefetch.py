"""Whether the o projection can read its weights from L2 at a 64-node verify over 32k keys: their
prefetch into L2 while the prefix attention runs (compute bound there, so the memory system has
room), at Qwen3-8B's shapes (random bf16 weights, each layer its own weights and KV).

    LAYERS=8 TOKENS=65 PF_SMS=4 python benchmarks/l2_prefetch.py OUT.json

First the premise alone, each as one CUDA graph: o_proj (65 rows, the residual added in place) after
a 134 MB read (one layer's KV at 32k, which leaves nothing of the weights in L2): cold; with its
weights prefetched (`prefetch.global.L2::evict_last`) before that read; prefetched right after it;
read by a kernel right after it. Then layers in a row (the engine's attention through
`masked_attention`, o_proj, gate/up, SwiGLU, down), us a layer, medians of 3 passes:
`base` as the engine runs them; `side_pf` a prefetch kernel over W_o (PF_SMS programs) on a side
stream, forked before the attention and joined before o_proj; `side_pf_n` the same without the
evict_last priority; `demote` side_pf also putting the previous layer's W_o back to normal
priority (`applypriority`); `attn_only` the attention alone.
"""
import json, os, statistics, sys
import torch, triton, triton.language as tl
from ddtree.kernels.graph_timing import median_replay_ms
from ddtree.kernels.tree_attention import masked_attention
from ddtree.tree import build_tree

OUT = sys.argv[1]  # the JSON written
torch.manual_seed(0)
dev = "cuda"
H, HQ, HKV, D, I = 4096, 32, 8, 128, 12288
N, CTX = int(os.environ.get("TOKENS", "65")), 32768
LAYERS = int(os.environ.get("LAYERS", "8"))
PF_SMS = int(os.environ.get("PF_SMS", "4"))


@triton.jit
def _read(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def _prefetch(x_ptr, n_lines, old_ptr, n_old, LINES: tl.constexpr, POLICY: tl.constexpr, DEMOTE: tl.constexpr):
    pid = tl.program_id(0)
    if DEMOTE:
        for start in range(pid * LINES, n_old, tl.num_programs(0) * LINES):
            idx = tl.minimum(start + tl.arange(0, LINES), n_old - 1).to(tl.int64)
            tl.inline_asm_elementwise("applypriority.global.L2::evict_normal [$1], 128; mov.u32 $0, 0;", "=r,l",
                                      [old_ptr + idx * 64], dtype=tl.int32, is_pure=False, pack=1)
    for start in range(pid * LINES, n_lines, tl.num_programs(0) * LINES):
        idx = tl.minimum(start + tl.arange(0, LINES), n_lines - 1).to(tl.int64)
        if POLICY == 1:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                      [x_ptr + idx * 64], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                      [x_ptr + idx * 64], dtype=tl.int32, is_pure=False, pack=1)


scratch = torch.empty(1 << 20, device=dev)


def read(x):
    _read[(264,)](x, x.numel(), scratch, BLOCK=1024)


def prefetch(w, policy=1, old=None, programs=PF_SMS):
    lines = w.numel() // 64
    _prefetch[(programs,)](w, lines, old if old is not None else w, (old.numel() // 64) if old is not None else 0,
                           LINES=1024, POLICY=policy, DEMOTE=old is not None, num_warps=8)


def graph_ms(fn, repeats=30):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay(); torch.cuda.synchronize()
    return median_replay_ms(g, repeats)


res = {"tokens": N, "context": CTX, "layers": LAYERS, "pf_sms": PF_SMS, "gpu": torch.cuda.get_device_name()}


def premise() -> dict:
    """o_proj alone after a 134 MB read, its weights cold or prefetched (ms a graph)."""
    kv = torch.randn(2 * CTX * HKV * D, device=dev, dtype=torch.bfloat16)
    wo = torch.randn(H, H, device=dev, dtype=torch.bfloat16) * 0.02
    x = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
    y = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
    t = {}
    t["kv"] = graph_ms(lambda: read(kv))
    t["kv_o"] = graph_ms(lambda: (read(kv), y.addmm_(x, wo.t())))
    t["pf_kv"] = graph_ms(lambda: (prefetch(wo), read(kv)))
    t["pf_kv_o"] = graph_ms(lambda: (prefetch(wo), read(kv), y.addmm_(x, wo.t())))
    t["kv_pf"] = graph_ms(lambda: (read(kv), prefetch(wo, programs=132)))
    t["kv_pf_o"] = graph_ms(lambda: (read(kv), prefetch(wo, programs=132), y.addmm_(x, wo.t())))
    t["kv_rw"] = graph_ms(lambda: (read(kv), read(wo)))
    t["kv_rw_o"] = graph_ms(lambda: (read(kv), read(wo), y.addmm_(x, wo.t())))
    return t


t = premise()
res["premise_ms"] = t
res["o_cold_us"] = (t["kv_o"] - t["kv"]) * 1000
res["o_after_pf_then_kv_us"] = (t["pf_kv_o"] - t["pf_kv"]) * 1000
res["o_after_pf_us"] = (t["kv_pf_o"] - t["kv_pf"]) * 1000
res["o_after_read_us"] = (t["kv_rw_o"] - t["kv_rw"]) * 1000
print(json.dumps(res), flush=True)

# layers
keys = -(-(CTX + N) // 256) * 256
layers = []
for i in range(LAYERS):
    cache = torch.randn(2, keys, HKV, D, device=dev, dtype=torch.bfloat16)
    layers.append(dict(k=cache[0], v=cache[1], wo=torch.randn(H, H, device=dev, dtype=torch.bfloat16) * 0.02,
                       wgu=torch.randn(2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02,
                       wd=torch.randn(H, I, device=dev, dtype=torch.bfloat16) * 0.02))
q = torch.randn(N, HQ, D, device=dev, dtype=torch.bfloat16)
logp = torch.log_softmax(torch.randn(15, 1000, device=dev), dim=-1)
block = build_tree(logp, torch.tensor(1, device=dev), N - 1).visible
prefix = torch.tensor(CTX, device=dev)
h = torch.randn(N, H, device=dev, dtype=torch.bfloat16)
side = torch.cuda.Stream()


def forward(variant):
    prev = None
    for L in layers:
        main = torch.cuda.current_stream()
        if variant != "base":
            side.wait_stream(main)
            with torch.cuda.stream(side):
                prefetch(L["wo"], policy=0 if variant == "side_pf_n" else 1,
                         old=prev if variant == "demote" else None)
        a = masked_attention(q, L["k"], L["v"], block, D ** -0.5, prefix_len=prefix, min_prefix=CTX)
        if variant != "base":
            main.wait_stream(side)
        h.addmm_(a.reshape(N, HQ * D), L["wo"].t())
        g = h @ L["wgu"].t()
        h.addmm_(torch.nn.functional.silu(g[:, :I]) * g[:, I:], L["wd"].t())
        prev = L["wo"]


def attn_only():
    for L in layers:
        masked_attention(q, L["k"], L["v"], block, D ** -0.5, prefix_len=prefix, min_prefix=CTX)


variants = ["base", "side_pf", "side_pf_n", "demote"]
times = {v: [] for v in variants + ["attn_only"]}
for rep in range(3):
    for v in variants:
        times[v].append(graph_ms(lambda: forward(v)) * 1000 / LAYERS)
    times["attn_only"].append(graph_ms(attn_only) * 1000 / LAYERS)
res["us_per_layer"] = {v: statistics.median(ts) for v, ts in times.items()}
res["us_per_layer_all"] = times
print(json.dumps(res["us_per_layer"]), flush=True)
json.dump(res, open(OUT, "w"), indent=1)
