"""Building blocks shared by the target and the drafter: RMSNorm, rotary tables, SwiGLU MLP, attention."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ddtree.kernels import blaslt, tree_attention
from ddtree.models.configs import RopeConfig
from ddtree.models.fused import mask_bias, rms_norm, rotate


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [rotary_dim / 2] in float32, with the config's scaling applied."""
    rotary_dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif rope.rope_type == "yarn":
        inv_freq = _yarn_inv_freq(rope, rotary_dim, inv_freq)
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, rotary_dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN's frequencies (arXiv 2309.00071): the dims that turn fewer than beta_slow times over
    the pretrained length are interpolated (divided by the factor), those that turn more than
    beta_fast times are kept, and a linear ramp blends the dims between."""
    def dim_turning(turns: float) -> float:  # the dim whose wavelength fits the pretrained length `turns` times
        return (rotary_dim * math.log(rope.original_max_position_embeddings / (turns * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = dim_turning(rope.beta_fast), dim_turning(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # a ramp of no width: a step
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / rope.factor * ramp + inv_freq * (1 - ramp)


class RotaryTable(nn.Module):
    """Precomputed cos/sin for positions [0, max_positions), side by side in one table
    [max_positions, 2 * rotary_dim], so that a forward gathers its positions' rows once."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.rotary_dim = emb.shape[-1]
        scale = rope.attention_factor  # YaRN's; 1 otherwise
        self.register_buffer("cos_sin", torch.cat([emb.cos() * scale, emb.sin() * scale], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> cos, sin [N, rotary_dim] in dtype (views of one gathered [N, 2 * rotary_dim])."""
        rows = self.cos_sin[positions].to(dtype)
        return rows[:, : self.rotary_dim], rows[:, self.rotary_dim :]


apply_rope = rotate  # x [N, heads, head_dim], cos/sin [N, rotary_dim]


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matrix."""

    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


@dataclass
class RowSpan:
    """One sequence of a packed forward (several sequences' tokens in one batch, `ddtree.batch`):
    its tokens' rows in the batch, the first of its cache slots, and the attention meta it would
    have alone (slots and key lengths counted from `first_slot`); for a hybrid target, its own
    recurrent state (`recurrent_state.RecurrentState`), which its recurrent layers run from."""

    tokens: slice
    first_slot: int
    meta: "AttentionMeta"
    recurrent: object = None


@dataclass
class PaddedRows:
    """A packed forward's rows laid out for `tree_attention.batched_masked_attention` (one launch
    for every row): R rows of M places, row b's tokens at places b * M .. b * M + n_b - 1, then
    padding (its outputs are dropped).

    `block_mask` [R, M, C] bool: row b's block mask in its top-left corner, False elsewhere;
    `prefix_len`, `first_slot` [R] long on the device; `max_kv`: a bound on the keys any row sees,
    counted from its first slot (the key split is planned over it, so the launch's shapes do not
    depend on the prefix lengths). `gather` [R * M] long: the packed token each place takes its
    query from (padding: its row's first token); `scatter` [N] long: the place of each output row,
    row after row (the packed order where rows follow one another, as `BatchEngine` packs them).
    Both None when the forward's tokens are already laid out so (N = R * M), as a graph-captured
    batched round can pack them.

    The mask form (the drafter's sliding layers): `prefix_len` None, `block_mask` [R, M, max_kv]
    each row's whole mask over its keys (counted from its first slot) and `ranges` [R * M, 2] its
    `tree_attention.key_range`."""

    block_mask: torch.Tensor
    prefix_len: torch.Tensor | None
    first_slot: torch.Tensor
    max_kv: int
    gather: torch.Tensor | None = None
    scatter: torch.Tensor | None = None
    ranges: torch.Tensor | None = None

    @classmethod
    def from_rows(cls, rows: list[RowSpan], tokens: int) -> "PaddedRows | None":
        """The layout of `rows` (of a forward of `tokens` tokens), or None unless every row's meta
        is in the prefix form (prefix_len and block_mask)."""
        if not all(row.meta.block_mask is not None and row.meta.prefix_len is not None and row.meta.mask is None
                   for row in rows):
            return None
        spans = [range(*row.tokens.indices(tokens)) for row in rows]
        device = rows[0].meta.block_mask.device
        m = max(len(span) for span in spans)
        cols = max(row.meta.block_mask.shape[1] for row in rows)
        block_mask = torch.zeros(len(rows), m, cols, dtype=torch.bool, device=device)
        for b, row in enumerate(rows):
            block_mask[b, :len(spans[b]), :row.meta.block_mask.shape[1]] = row.meta.block_mask
        gather = [span[i] if i < len(span) else span[0] for span in spans for i in range(m)]
        scatter = [b * m + i for b, span in enumerate(spans) for i in range(len(span))]
        if gather == scatter == list(range(tokens)):  # rows of M tokens one after another: nothing to move
            gather = scatter = []
        first_slot = [row.first_slot for row in rows]
        index = torch.tensor(gather + scatter + first_slot, dtype=torch.long).to(device)  # one copy to the device
        gather, scatter, first_slot = index.split([len(gather), len(scatter), len(rows)])
        prefix_len = torch.stack([row.meta.prefix_len.reshape(()).to(device, torch.long) for row in rows])
        return cls(block_mask, prefix_len, first_slot, max(row.meta.kv_len for row in rows),
                   gather if len(gather) else None, scatter if len(scatter) else None)


@dataclass
class AttentionMeta:
    """What one forward needs to know about the cache, built once and shared by every layer.

    `write_slots` [N]: cache slots the N new tokens' keys/values go to.
    `kv_len`: keys [0, kv_len) are read (on CUDA a bucketed length, so that graphs can be reused).
    Which keys query i sees, one of:
    - `prefix_len` and `block_mask`: keys [0, prefix_len) (the committed context), then among keys
      prefix_len .. prefix_len + M - 1 those where block_mask [N, M] is True (a tree's ancestors,
      a drafter block's every column); later keys are padding. prefix_len: [] long on the device.
      `tree_attention` reads this form directly; `mask` is made from it only where needed. With
      `min_prefix`, a lower bound of prefix_len for every call this meta (or a graph made from
      it) serves, the kernel may take a long prefix's first keys through cuDNN. `chunk`: the
      forward is a prefill chunk (`engine.prefill_chunks`): block_mask is the lower triangle and
      prefix_len equals min_prefix, so that the block may go through a causal kernel.
    - `mask` [N, kv_len] bool: True where query i may see key j (the drafter's sliding layers).
    - neither, with `causal`: plain causal attention from an empty cache (prefill).

    A packed forward sets `rows` ([RowSpan]): `write_slots` and `kv_len` then cover every row's
    slots, and each row attends to its own slots alone, with its own meta (`attend`). On CUDA,
    when every row is in the prefix form, all rows attend in one batched launch through `padded`
    ([PaddedRows]: given precomputed, or made from `rows` once per forward by `padded_rows`); a
    forward may set `padded` without `rows` when its tokens are already in the padded layout.

    Recurrent layers (hybrid targets) read three more fields:
    - `parents` [N] long (a tree's parent index per node, -1 for the root; nodes in topological
      order) and `depths` [N]: the forward is a round's verify (every budget, `ar`'s one node
      included), which reads the recurrent state and writes none, and stashes what the commit of
      the accepted path needs into `scratch`;
    - otherwise the N tokens are a sequence that advances the state (from zero when `causal`, a
      new sequence's prefill), and `length` ([] long or None = N) says how many rows are real:
      the state is left as after the first `length` tokens (the rest is padding).
    """

    write_slots: torch.Tensor
    kv_len: int
    mask: torch.Tensor | None = None
    causal: bool = False
    ranges: torch.Tensor | None = None  # `tree_attention.key_range(mask)` when the caller made it with the mask
    prefix_len: torch.Tensor | None = None
    block_mask: torch.Tensor | None = None
    min_prefix: int = 0  # a bound prefix_len never falls below at these shapes (a graph's replays included)
    chunk: bool = False  # a prefill chunk: block_mask causal, prefix_len == min_prefix
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    length: torch.Tensor | None = None
    scratch: object | None = None  # a hybrid target's per-round stash (`RecurrentScratch`)
    rows: list[RowSpan] | None = None
    padded: PaddedRows | None = None
    _shared: dict = field(default_factory=dict, repr=False)  # what all layers derive from the mask, made once

    def dense_mask(self) -> torch.Tensor | None:
        """`mask`, or [N, kv_len] made once from prefix_len and block_mask (None for causal)."""
        if self.mask is not None or self.block_mask is None:
            return self.mask
        if "mask" not in self._shared:
            self._shared["mask"] = tree_attention.prefix_block_mask(self.prefix_len, self.block_mask, self.kv_len)
        return self._shared["mask"]

    def padded_rows(self) -> PaddedRows | None:
        """`padded`, or the layout made once from `rows` (None unless every row is in the prefix form)."""
        if self.padded is not None or self.rows is None:
            return self.padded
        if "padded" not in self._shared:
            self._shared["padded"] = PaddedRows.from_rows(self.rows, self.write_slots.shape[0])
        return self._shared["padded"]

    def bias(self, group: int, dtype: torch.dtype, make=mask_bias) -> torch.Tensor:
        """The mask as an additive bias [group * N, kv_len] laid out for `attend`'s GQA grouping (the
        path without the Triton kernel), computed once per forward (by `make`: `fused.mask_bias`,
        compiled on CUDA) and shared by all layers."""
        key = (group, dtype)
        if key not in self._shared:
            self._shared[key] = make(self.dense_mask(), group, dtype)
        return self._shared[key]

    def key_range(self) -> torch.Tensor:
        """`tree_attention.key_range(mask)` [N, 2], computed once per forward and shared by all layers."""
        if self.ranges is not None:
            return self.ranges
        if "key_range" not in self._shared:
            self._shared["key_range"] = tree_attention.key_range(self.dense_mask())
        return self._shared["key_range"]


def _one_prefill_chunk(meta: AttentionMeta) -> bool:
    """A packed forward of one row that is a prefill chunk (always eager)."""
    return meta.rows is not None and len(meta.rows) == 1 and meta.rows[0].meta.chunk


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta, scale: float,
           make_bias=mask_bias) -> torch.Tensor:
    """q: [N, Hq, D]; k, v: [T, Hkv, D] (T = meta.kv_len). Returns [N, Hq * D].

    With a mask on CUDA: `kernels.tree_attention` (keys split across the GPU). Elsewhere the query
    heads that share a KV head are stacked along the query axis ([Hkv, group * N, D]) so that keys
    and values are read once per KV head, never copied, with the mask as an additive bias.

    A packed batch (`meta.rows`): each sequence against its own slots, as if alone; on CUDA with
    every row in the prefix form, one batched launch (`attend_padded`), else a call per row. One
    row that is a prefill chunk (`chunk`) is attended alone, as `Engine` attends it: its long
    prefix through the tree attention's prefix kernel, its own keys through a causal one.
    """
    if meta.rows is not None or meta.padded is not None:
        if q.is_cuda and tree_attention.supported(q, k) and not _one_prefill_chunk(meta):
            padded = meta.padded_rows()
            if padded is not None:
                return attend_padded(q, k, v, padded, scale)
        if meta.rows is None:
            raise ValueError("a padded batch without rows is attended by the Triton kernel alone (CUDA)")
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            # Each row's first slot here is the host's, which a graph would keep after its row changed hands.
            raise RuntimeError("a packed batch's rows cannot be attended one by one in a CUDA graph; "
                               "it needs the Triton tree attention kernel (`tree_attention.supported`)")
        return torch.cat([attend(q[row.tokens], k[row.first_slot:row.first_slot + row.meta.kv_len],
                                 v[row.first_slot:row.first_slot + row.meta.kv_len], row.meta, scale, make_bias)
                          for row in meta.rows])
    n, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    kh = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, T, D]
    vh = v.transpose(0, 1).unsqueeze(0)
    if meta.mask is None and meta.block_mask is None:
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, N, D]
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=meta.causal, scale=scale, enable_gqa=group > 1)
        return out[0].transpose(0, 1).reshape(n, hq * d)
    if q.is_cuda and tree_attention.supported(q, k):
        if meta.mask is None:
            return tree_attention.masked_attention(q, k, v, meta.block_mask, scale, prefix_len=meta.prefix_len,
                                                   min_prefix=meta.min_prefix, causal_block=meta.chunk)
        return tree_attention.masked_attention(q, k, v, meta.mask, scale, meta.key_range())
    qg = q.view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(1, hkv, group * n, d)
    bias = meta.bias(group, q.dtype, make_bias)[None, None]
    out = F.scaled_dot_product_attention(qg, kh, vh, attn_mask=bias, scale=scale)  # [1, Hkv, group * N, D]
    return out.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq * d)


def attend_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, padded: PaddedRows, scale: float) -> torch.Tensor:
    """q [N, Hq, D] (a packed forward's tokens); k, v: the cache's keys and values from slot 0 ->
    [N, Hq * D]: every row of `padded` in one `tree_attention.batched_masked_attention` launch."""
    q = q if padded.gather is None else q[padded.gather]
    out = tree_attention.batched_masked_attention(q, k, v, padded.block_mask, scale, padded.prefix_len,
                                                  padded.first_slot, padded.max_kv, ranges=padded.ranges)
    return out if padded.scatter is None else out[padded.scatter]


_FLOAT32_OUT_MM: dict[torch.device, bool] = {}


def _float32_out_mm_works(device: torch.device) -> bool:
    """Whether this build has cuBLAS's half-precision product with a float32 result (`mm.dtype`)."""
    if device not in _FLOAT32_OUT_MM:
        try:
            a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            _FLOAT32_OUT_MM[device] = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            _FLOAT32_OUT_MM[device] = False
    return _FLOAT32_OUT_MM[device]


def logits_float32(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] @ weight [V, H]^T -> logits [N, V] float32. On CUDA in bf16/fp16 the product
    accumulates in float32 and is returned unrounded, so the greedy choice does not hinge on
    rounding logits to 8 mantissa bits (exact ties there are common, and any rounding difference
    between verify batch shapes would flip them)."""
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16) and _float32_out_mm_works(hidden.device):
        return blaslt.linear(hidden, weight, out_dtype=torch.float32)
    return F.linear(hidden, weight).float()
