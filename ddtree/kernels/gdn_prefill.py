"""A hybrid target's prompt through flash-linear-attention's chunked gated delta rule (`fla-core`).

The token-loop kernel (`kernels.gdn_tree.recurrent_gated_delta`) walks a prompt one token at a
time: on the H200 at Qwen3.6-27B's heads it took 11.8 us a layer for 16 tokens, about 0.5 us a
token past the first (`gdn_kernels_h200.json`), so an 8192-token prompt spends an estimated
0.2 s of its 0.96 s time to first token there (48 layers; the floor is 0.53 s), not measured
apart. flash-linear-attention's `chunk_gated_delta_rule` runs the same recurrence in chunks of 64
tokens on tensor cores (the intra-chunk WY form, one state pass per chunk), with grouped value
heads (Hv a multiple of Hk) and an initial and final state in our layout ([Hv, Dk, Dv], float32).

Where it runs (`usable`): fla importable (`pip install "ddtree[fla]"`), CUDA, 2-byte values (its
products round through bf16/fp16 and TF32: float32 targets keep the token loop, exact in float32,
which their parity tests rely on), a float32 contiguous state, at least `MIN_TOKENS` tokens, and
`DDTREE_FLA_PREFILL` not 0. By default (`graphs`) also inside CUDA graph captures, which serve the
padded prefills of prompts up to 1024 tokens: the library's calls make no host sync that we found,
and a graph's warm-up run, before its capture, is where its kernels are tuned. `DDTREE_FLA_PREFILL=1`
keeps the token loop inside captures; `0` everywhere.

Measured on the H200 at Qwen3.6-27B shape (benchmarks/README.md): time to first token 59.1 ->
48.3 ms for 512 tokens, and 1.77x -> 1.52x its floor for 8192 (963 ms with the token loop, 784
with this); the GPU tests hold it to the token loop's results within bf16 rounding.

Rows at or past `length` are a padded prefill's padding: their decay and write strength are set
to 0 (decay exp(0) = 1), so the final state is the one after the first `length` rows, as the
token loop leaves it.
"""
from __future__ import annotations

import logging
import os
from typing import Callable

import torch

log = logging.getLogger("ddtree")

_SWITCH = os.environ.get("DDTREE_FLA_PREFILL", "graphs")
if _SWITCH not in ("0", "1", "graphs"):
    raise ValueError(f"DDTREE_FLA_PREFILL must be 0, 1 or graphs, got {_SWITCH!r}")
ENABLED = _SWITCH in ("1", "graphs")  # where fla-core is installed
IN_GRAPHS = _SWITCH == "graphs"  # also inside CUDA graph captures (the padded prefills)
MIN_TOKENS = 64  # shorter runs (an `ar` step, a commit, a short prompt) fill less than one chunk: the token loop
VALUE_DTYPES = (torch.bfloat16, torch.float16)
_RULE: list = []  # [flash-linear-attention's chunk_gated_delta_rule, or None], imported at the first ask


def chunk_rule() -> Callable | None:
    """flash-linear-attention's chunked rule, or None where `fla-core` is not installed (imported
    only once asked: it is a GPU path, opt-in)."""
    if not _RULE:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except ImportError:  # the CPU install, or a GPU one without the `fla` extra
            chunk_gated_delta_rule = None
        _RULE.append(chunk_gated_delta_rule)
    return _RULE[0]


def usable(v: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether `chunked_gated_delta` runs these inputs (module docstring). v [T, Hv, Dv]; state
    [Hv, Dk, Dv]."""
    return (ENABLED and v.is_cuda and v.dtype in VALUE_DTYPES and v.shape[0] >= MIN_TOKENS
            and state.dtype == torch.float32 and state.is_contiguous()
            and (IN_GRAPHS or not torch.cuda.is_current_stream_capturing()) and chunk_rule() is not None)


def chunked_or_none(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, length: torch.Tensor | int | None = None,
                    chunk: Callable | None = None) -> torch.Tensor | None:
    """`chunked_gated_delta`, or None (the state untouched) where the library fails: on a GPU or a
    shape it does not handle its kernels fail to build or launch, once, in the first prompt or a
    graph's warm-up, before any capture. It is then turned off for the process, with a warning,
    and the caller runs the token loop."""
    global ENABLED
    try:
        return chunked_gated_delta(q, k, v, g, beta, state, length, chunk)
    except Exception as exc:  # the library's own errors: Triton's compile and launch ones, its checks
        ENABLED = False
        first_line = (str(exc).splitlines() or [""])[0][:200]
        log.warning("flash-linear-attention's chunked rule failed (%s: %s); hybrid prompts use the token-loop "
                    "kernel from now on", type(exc).__name__, first_line)
        return None


def chunked_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor, length: torch.Tensor | int | None = None,
                        chunk: Callable | None = None) -> torch.Tensor:
    """A run of tokens from `state`, which is updated in place to the state after its first `length`
    rows (all when None). q, k [T, Hk, Dk] (L2-normalised, q scaled by Dk ** -0.5, as
    `gated_deltanet.normalize_qk` makes them); v [T, Hv, Dv]; g (log-decay), beta [T, Hv];
    state [Hv, Dk, Dv] float32. -> o [T, Hv, Dv] float32.

    chunk: the chunked rule to call, with `chunk_gated_delta_rule`'s arguments (tests pass a
    reference of the same contract; None: flash-linear-attention's)."""
    chunk = chunk or chunk_rule()
    t = v.shape[0]
    g, beta = g.float(), beta.float()
    if length is not None:
        live = torch.arange(t, device=v.device) < length
        g = g * live[:, None]
        beta = beta * live[:, None]
    dtype = v.dtype
    o, final = chunk(q.to(dtype)[None], k.to(dtype)[None], v[None], g[None], beta.to(dtype)[None], scale=1.0,
                     initial_state=state[None], output_final_state=True)
    state.copy_(final[0])
    return o[0].float()
