"""How many KV cache slots a batched engine's sequences share (`BatchEngine(cache_slots=...)`):
given outright (`kv_cache_tokens`), or sized from the device's free memory, as vLLM's
`--gpu-memory-utilization` does.

    slots = batch_cache_slots(target_cfg, drafter_cfg, "bfloat16", max_rows=32, row_slots=41_474,
                              served_nodes=65, device=torch.device("cuda"), utilization=0.9)

Sized from memory: the process may hold `utilization` of the device's memory in all; what it
holds already (weights, the one-request engine's caches, compiled kernels) and what the batch will
allocate beside its KV (`batch_reserve_bytes`: a hybrid's recurrent states and verify stashes per
row, every row bucket's logits buffer for the served budgets, and a fixed margin for a round's and
a prefill chunk's temporaries) come off it, and the rest becomes KV slots at the pair's KV bytes per
token (`ddtree.memory_plan`). Never more than max_rows sequences at the context limit use, never
fewer than one such sequence needs (else a clear error).
"""
from __future__ import annotations

import torch

from ddtree.config import DDTreeError
from ddtree.memory_plan import (FLOAT32, GiB, drafter_kv_bytes_per_token, recurrent_scratch_bytes,
                                recurrent_state_bytes, target_kv_bytes_per_token)
from ddtree.round_costs import row_counts

TEMPORARIES_BYTES = 1 * GiB  # a round's and a prefill chunk's activations, allocator slack
LOGITS_BUDGETS = 3  # the served budgets whose logits buffers every row bucket keeps (ar, 15, 63 by default)


def kv_bytes_per_slot(target_cfg, drafter_cfg, dtype: str) -> int:
    """Target + drafter KV bytes of one cache slot."""
    drafter = drafter_kv_bytes_per_token(drafter_cfg, dtype) if drafter_cfg is not None else 0
    return target_kv_bytes_per_token(target_cfg, dtype) + drafter


def batch_reserve_bytes(target_cfg, dtype: str, max_rows: int, served_nodes: int) -> int:
    """What a batched engine allocates beside its KV cache for trees of up to served_nodes nodes:
    per row a hybrid's recurrent state and verify stash, per row bucket the float32 logits buffers
    of LOGITS_BUDGETS budgets, and TEMPORARIES_BYTES."""
    per_row = recurrent_state_bytes(target_cfg, dtype) + recurrent_scratch_bytes(target_cfg, served_nodes, dtype)
    # a [rows x nodes, V] float32 buffer per row bucket (1, 2, 4, ..., max_rows rows) and budget
    logits = sum(row_counts(max_rows)) * served_nodes * target_cfg.vocab_size * FLOAT32 * LOGITS_BUDGETS
    return max_rows * per_row + logits + TEMPORARIES_BYTES


def batch_cache_slots(target_cfg, drafter_cfg, dtype: str, max_rows: int, row_slots: int, served_nodes: int,
                      device: torch.device, utilization: float | None = None, kv_cache_tokens: int | None = None,
                      memory: tuple[int, int] | None = None) -> int | None:
    """The KV slots of a batched engine of max_rows rows whose longest sequence holds row_slots
    slots -> kv_cache_tokens when given; else, on CUDA with a utilization, the slots its free
    memory holds (at most max_rows x row_slots); else None (the engine's default, max_rows x
    row_slots). memory: (free, total) bytes, default `torch.cuda.mem_get_info(device)`."""
    if kv_cache_tokens is not None:
        if kv_cache_tokens < row_slots:
            raise DDTreeError(f"kv_cache_tokens={kv_cache_tokens} cannot hold one sequence at the context limit, "
                              f"which needs {row_slots} slots (lower max_model_len, or give more)", "kv_cache_tokens")
        return kv_cache_tokens
    if utilization is None or device.type != "cuda":
        return None
    if not 0 < utilization <= 1:
        raise DDTreeError(f"gpu_memory_utilization must be in (0, 1], got {utilization}", "gpu_memory_utilization")
    free, total = memory if memory is not None else torch.cuda.mem_get_info(device)
    held = total - free  # by this process and any other
    reserve = batch_reserve_bytes(target_cfg, dtype, max_rows, served_nodes)
    room = int(utilization * total) - held - reserve
    per_slot = kv_bytes_per_slot(target_cfg, drafter_cfg, dtype)
    slots = max(room, 0) // per_slot
    if slots < row_slots:
        raise DDTreeError(
            f"gpu_memory_utilization={utilization}: {max(room, 0) / GiB:.2f} GiB are left for the KV cache "
            f"({total / GiB:.1f} GiB on the device, {held / GiB:.1f} GiB in use, "
            f"{reserve / GiB:.2f} GiB kept for the batch's "
            f"buffers), fewer than one sequence at the context limit needs ({row_slots} slots of "
            f"{per_slot} bytes: {row_slots * per_slot / GiB:.2f} GiB); lower --max-model-len or --max-num-seqs, "
            "or raise --gpu-memory-utilization", "gpu_memory_utilization")
    return min(slots, max_rows * row_slots)
