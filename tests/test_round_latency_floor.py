"""The round benchmark's two floors (`benchmarks/round_latency.py`): the maximum of the forward's
bytes and FLOPs taken whole, and taken for the matmuls and the attention apart and added."""
from __future__ import annotations

import pytest

from benchmarks.round_latency import forward_floor, forward_floor_by_kind

H200 = {"bandwidth_Bps": 4.23e12, "bf16_flops": 7.92e14}
PARAMS = 7_568_097_280  # Qwen3-8B's matmul weights, LM head included, embedding not
KV_TOKEN = 2 * 36 * 8 * 128 * 2  # bytes of keys and values a token, 36 layers


def attention(tokens: int, context: int) -> tuple[int, int]:
    """(KV bytes read, attention FLOPs) of `tokens` queries over `context` keys at Qwen3-8B heads."""
    return KV_TOKEN * context, 4 * tokens * context * 128 * 32 * 36


@pytest.mark.parametrize("tokens", [1, 17, 257])
def test_the_floors_agree_where_both_kinds_have_one_bound(tokens):
    kv, flops = attention(tokens, 32768 + tokens)
    whole = forward_floor(PARAMS, tokens, kv, H200, extra_flops=flops)
    assert forward_floor_by_kind(PARAMS, tokens, kv, H200, extra_flops=flops) == pytest.approx(whole, rel=1e-9)


def test_the_floor_by_kind_adds_the_attentions_products_to_the_weights_stream():
    """65 tokens over 32k keys: the matmuls are bound by the weights' bytes, the attention by its
    products, so the floor by kind is the two added (5.17 ms) where the whole forward's is its
    bytes (4.72)."""
    kv, flops = attention(65, 32768 + 65)
    whole = forward_floor(PARAMS, 65, kv, H200, extra_flops=flops)
    by_kind = forward_floor_by_kind(PARAMS, 65, kv, H200, extra_flops=flops)
    assert whole == pytest.approx((2 * PARAMS + kv) / H200["bandwidth_Bps"])
    assert by_kind == pytest.approx(2 * PARAMS / H200["bandwidth_Bps"] + flops / H200["bf16_flops"])
    assert by_kind > whole * 1.09
