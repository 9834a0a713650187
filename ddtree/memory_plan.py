"""Device memory of a target + drafter pair in ddtree, computed from their configs alone (no torch,
no weights: `ddtree serve` can size a deployment before it loads anything).

Every figure counts what ddtree allocates today (tests/test_memory_plan.py compares each with the
`nbytes` of the tensors a loaded engine holds), with b = bytes per element of the model dtype:

- weights: every parameter x b (a tied LM head once), plus the drafter's stacked context k/v
  matrix that `DFlashDrafter.fuse_projections` copies (L_d x 2 Hkv D H elements, and the k norms);
- rotary tables: one per model, (context + MAX_TREE_BUDGET + 1) positions x 2 x rotary_dim x b;
- KV cache per token: 2 x Hkv x D x b x layers with a KV cache: the target's attention layers
  (a hybrid's full-attention layers only) and every drafter layer. A sliding-window drafter layer
  gets a slot for every position too: ddtree's drafter cache is one [L, slots, Hkv, D] tensor;
- cache slots: context + MAX_TREE_BUDGET + 1 + kv_bucket (the largest tree's scratch slots past the
  longest sequence, bucketed; kv_bucket is 256 with CUDA graphs, 1 without);
- per sequence, hybrid targets: per Gated DeltaNet layer a float32 state Hv x Dk x Dv x 4 and a
  conv window (K - 1) x conv_dim x b;
- per tree budget (N = nodes verified per round): the round's buffers (RoundBuffers: tree, mask
  N x N, features N x taps x H x b, summary, log-prob rows), a hybrid's verify stash per node and
  Gated DeltaNet layer (RecurrentScratch: conv_dim x b + 4 (Hk Dk + Hv Dv + Hv)), and with CUDA
  graphs the budget's one logits buffer N x V x 4, where each of its front graphs (one per KV
  bucket) leaves the verify's logits; plus one [1, V] float32 logits row per prefill graph.

Not counted: activations and allocator slack of a forward (the temporaries of a round, a long
prefill's [T, ...] tensors, T at most `Engine.prefill_chunk`, the drafter's [b - 1, V] logits), torch.compile and Triton workspaces,
the fused tree build's ranking buffers (a few KiB per budget) and the CUDA context. Measured peak
memory on a GPU is a separate figure.

ddtree's engine serves one sequence at a time; `max_sequences` says how many of its per-sequence
caches (KV slots and recurrent state) fit side by side beside one copy of everything shared.
"""
from __future__ import annotations

from dataclasses import dataclass

from ddtree.config import MAX_TREE_BUDGET
from ddtree.models.configs import DrafterConfig, RopeConfig, TargetConfig
from ddtree.tree_shape import DEFAULT_TREE_BUDGET, TreeShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
INT64, FLOAT32, BOOL = 8, 4, 1
GRAPH_KV_BUCKET = 256  # Engine.kv_bucket with CUDA graphs; 1 without
PREFILL_PAD_MAX = 1024  # Engine pads prompts of up to this many tokens to a graph's length
MAX_LOGPROBS = 20  # ddtree.logprobs: top alternatives a request may ask for
GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


def dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


# -- weights ---------------------------------------------------------------------------------------

def _linear(fan_in: int, fan_out: int, bias: bool) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def _mlp(cfg) -> int:
    """SwiGLU: gate and up [2 I, H], down [H, I]."""
    return _linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias) + \
        _linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias)


def target_parameter_count(cfg: TargetConfig) -> int:
    """Elements of the target's parameters: embeddings V H, per layer its mixer, SwiGLU and two
    norms, the final norm, and the LM head V H unless tied to the embeddings."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    bias = cfg.attention_bias
    total = cfg.vocab_size * h + h + (0 if cfg.tie_word_embeddings else cfg.vocab_size * h)
    norms = 2 * h + _mlp(cfg)
    if not cfg.hybrid:
        attention = _linear(h, q + 2 * kv, bias) + _linear(q, h, bias) + (2 * d if cfg.qk_norm else 0)
        return total + cfg.num_hidden_layers * (norms + attention)
    g = cfg.gdn
    # Gated attention: q_proj emits a query and a gate per head; q/k norms always.
    attention = _linear(h, 2 * q + 2 * kv, bias) + _linear(q, h, bias) + 2 * d
    # Gated DeltaNet: in_proj (qkv, z, b, a), conv [C, K], A_log and dt_bias [Hv], norm [Dv], out_proj.
    linear = (h * (g.conv_dim + g.value_dim + 2 * g.num_value_heads) + g.conv_dim * g.conv_kernel
              + 2 * g.num_value_heads + g.value_head_dim + g.value_dim * h)
    return total + cfg.num_hidden_layers * norms + len(cfg.attention_layers) * attention + _linear_layers(cfg) * linear


def drafter_parameter_count(cfg: DrafterConfig) -> int:
    """Elements of the drafter's parameters (it borrows the target's embeddings and LM head):
    per layer q/k/v/o, q/k norms, SwiGLU, two norms; fc [H, taps H]; hidden and final norms."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    bias = cfg.attention_bias
    layer = (_linear(h, q, bias) + 2 * _linear(h, kv, bias) + _linear(q, h, bias) + 2 * d
             + _mlp(cfg) + 2 * h)
    return cfg.num_hidden_layers * layer + len(cfg.target_layer_ids) * h * h + 2 * h


def drafter_context_kv_count(cfg: DrafterConfig) -> int:
    """Elements of the copy `fuse_projections` makes for appending context in one matmul: every
    layer's k and v rows [L 2 Hkv D, H] (and biases), and the k norms [L, D]."""
    kv = cfg.num_key_value_heads * cfg.head_dim
    return cfg.num_hidden_layers * (_linear(cfg.hidden_size, 2 * kv, cfg.attention_bias) + cfg.head_dim)


def target_weight_bytes(cfg: TargetConfig, dtype: str) -> int:
    return target_parameter_count(cfg) * dtype_bytes(dtype)


def drafter_weight_bytes(cfg: DrafterConfig, dtype: str) -> int:
    """Parameters plus the fused context k/v copy, as an engine holds them."""
    return (drafter_parameter_count(cfg) + drafter_context_kv_count(cfg)) * dtype_bytes(dtype)


def rotary_table_bytes(rope: RopeConfig, head_dim: int, positions: int, dtype: str) -> int:
    """RotaryTable: cos and sin side by side, [positions, 2 rotary_dim] in the model dtype, where
    rotary_dim = 2 ceil(int(head_dim x partial_rotary_factor) / 2)."""
    rotary_dim = 2 * -(-int(head_dim * rope.partial_rotary_factor) // 2)
    return positions * 2 * rotary_dim * dtype_bytes(dtype)


def table_positions(context: int) -> int:
    """Positions of each model's rotary table for a context limit (ddtree.llm.LLM)."""
    return context + MAX_TREE_BUDGET + 1


# -- caches --------------------------------------------------------------------------------------

def target_kv_bytes_per_token(cfg: TargetConfig, dtype: str) -> int:
    """2 (k, v) x Hkv x D x b x attention layers (all layers of a dense target)."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes(dtype) * len(cfg.attention_layers)


def drafter_kv_bytes_per_token(cfg: DrafterConfig, dtype: str) -> int:
    """2 x Hkv x D x b x every drafter layer: a sliding-window layer keeps a slot per position
    too (one cache tensor for all layers), though it reads at most its window."""
    return 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes(dtype) * cfg.num_hidden_layers


def cache_slots(context: int, kv_bucket: int) -> int:
    """Slots of each KV cache for a context limit: the largest tree's scratch past it, bucketed (Engine)."""
    return context + MAX_TREE_BUDGET + 1 + kv_bucket


def recurrent_state_bytes(cfg: TargetConfig, dtype: str) -> int:
    """A hybrid's per-sequence state (RecurrentState): per Gated DeltaNet layer Hv x Dk x Dv x 4
    (float32) plus the conv window (K - 1) x conv_dim x b. 0 for a dense target."""
    if not cfg.hybrid:
        return 0
    g = cfg.gdn
    per_layer = g.num_value_heads * g.key_head_dim * g.value_head_dim * FLOAT32 + \
        (g.conv_kernel - 1) * g.conv_dim * dtype_bytes(dtype)
    return _linear_layers(cfg) * per_layer


def recurrent_scratch_bytes(cfg: TargetConfig, nodes: int, dtype: str) -> int:
    """A hybrid's verify stash for a tree of `nodes` (RecurrentScratch), per node and Gated
    DeltaNet layer: conv inputs conv_dim x b, keys Hk Dk x 4, new values Hv Dv x 4, decays Hv x 4."""
    if not cfg.hybrid:
        return 0
    g = cfg.gdn
    per_node = g.conv_dim * dtype_bytes(dtype) + FLOAT32 * (g.key_dim + g.value_dim + g.num_value_heads)
    return _linear_layers(cfg) * nodes * per_node


def _linear_layers(cfg: TargetConfig) -> int:
    return cfg.num_hidden_layers - len(cfg.attention_layers)


# -- a tree budget's round ----------------------------------------------------------------------

def round_buffer_bytes(target: TargetConfig, drafter: DrafterConfig | None, budget: TreeShape, dtype: str) -> int:
    """A budget's device buffers (RoundBuffers), hybrid stash included, for N nodes, keep rows:
    tokens, parents, depths, choices, offsets N x 8; valid N; mask N x N; features N x taps H x b;
    summary (keep + 2) x 8; path keep x 8; log-probs keep x (4 + 20 x 4 + 20 x 8)."""
    block = drafter.block_size if drafter is not None else 0
    n = budget.nodes(block)
    keep = min(n, block or 1)
    features = len(drafter.target_layer_ids) * target.hidden_size if drafter is not None else 0
    tree = 5 * n * INT64 + n * BOOL + n * n * BOOL + n * max(features, 1) * dtype_bytes(dtype)
    host_read = (keep + 2) * INT64 + keep * INT64
    logprobs = keep * (FLOAT32 + MAX_LOGPROBS * FLOAT32 + MAX_LOGPROBS * INT64)
    return tree + host_read + logprobs + recurrent_scratch_bytes(target, n, dtype)


def verify_logits_bytes(target: TargetConfig, nodes: int) -> int:
    """The verify's logits [N, V] in float32: with CUDA graphs, the budget's logits buffer, which all
    of its front graphs share."""
    return nodes * target.vocab_size * FLOAT32


def front_graph_count(context: int, nodes: int, block_size: int, kv_bucket: int) -> int:
    """Front graphs of a budget for sequences of up to `context` tokens (Engine.front_kv_lens):
    one per KV bucket from n = 0 to n = context - 1, each reading n + max(N, b) slots."""
    span = max(nodes, block_size)

    def bucket(needed: int) -> int:
        return -(-needed // kv_bucket) * kv_bucket

    return (bucket(context - 1 + span) - bucket(span)) // kv_bucket + 1


def prefill_lengths(limit: int) -> list[int]:
    """The padded prefill lengths up to `limit` (ddtree.engine.prefill_lengths): 16, 24, 32, 48, ..."""
    lengths, x = [], 16
    while x <= limit:
        lengths.append(x)
        x = x * 3 // 2 if x & (x - 1) == 0 else x * 4 // 3
    return lengths


# -- a pair ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PairMemory:
    """The memory plan of a target (+ drafter) at a dtype and a tree budget. graphs: CUDA graphs on
    (ddtree's default on a GPU): KV bucket 256, padded prefill, a logits buffer per budget."""

    target: TargetConfig
    drafter: DrafterConfig | None = None
    dtype: str = "bfloat16"
    budget: TreeShape = DEFAULT_TREE_BUDGET
    graphs: bool = True

    def __post_init__(self):
        if self.drafter is None and self.budget.drafts:
            raise ValueError(f"tree budget {self.budget} needs a drafter; a target alone decodes with 'ar'")
        dtype_bytes(self.dtype)

    @property
    def kv_bucket(self) -> int:
        return GRAPH_KV_BUCKET if self.graphs else 1

    @property
    def block_size(self) -> int:
        return self.drafter.block_size if self.drafter is not None else 0

    @property
    def nodes(self) -> int:
        return self.budget.nodes(self.block_size)

    @property
    def target_weights(self) -> int:
        return target_weight_bytes(self.target, self.dtype)

    @property
    def drafter_weights(self) -> int:
        return drafter_weight_bytes(self.drafter, self.dtype) if self.drafter is not None else 0

    @property
    def weights(self) -> int:
        return self.target_weights + self.drafter_weights

    @property
    def kv_bytes_per_token(self) -> int:
        """Target and drafter KV bytes per cache slot."""
        drafter = drafter_kv_bytes_per_token(self.drafter, self.dtype) if self.drafter is not None else 0
        return target_kv_bytes_per_token(self.target, self.dtype) + drafter

    @property
    def state_bytes(self) -> int:
        """Fixed bytes per sequence: a hybrid's recurrent state and conv window."""
        return recurrent_state_bytes(self.target, self.dtype)

    @property
    def round_bytes(self) -> int:
        return round_buffer_bytes(self.target, self.drafter, self.budget, self.dtype)

    def table_bytes(self, context: int) -> int:
        """Both models' rotary tables for a context limit."""
        positions = table_positions(context)
        t = self.target
        total = rotary_table_bytes(t.rope, t.head_dim, positions, self.dtype)
        if self.drafter is not None:
            total += rotary_table_bytes(self.drafter.rope, self.drafter.head_dim, positions, self.dtype)
        return total

    def graph_output_bytes(self, context: int) -> int:
        """With graphs: the budget's verify logits buffer, and a logits row per prefill graph."""
        if not self.graphs:
            return 0
        prefills = len(prefill_lengths(min(PREFILL_PAD_MAX, context)))
        return verify_logits_bytes(self.target, self.nodes) + prefills * self.target.vocab_size * FLOAT32

    def engine_bytes(self, context: int) -> int:
        """The engine's own small tensors: the drafter's input block [b, H] and block mask [b, b],
        the padded prompt (graphs), and n, root and ar's acceptance length (int64 each)."""
        prompt = prefill_lengths(min(PREFILL_PAD_MAX, context))[-1:] if self.graphs else []
        b = self.block_size
        drafter = 0
        if self.drafter is not None:
            drafter = b * self.target.hidden_size * dtype_bytes(self.dtype) + b * b * BOOL
        return drafter + sum(prompt) * INT64 + 3 * INT64

    def shared_bytes(self, context: int) -> int:
        """Everything held once, whatever the number of sequences, for a context limit."""
        return (self.weights + self.table_bytes(context) + self.round_bytes + self.graph_output_bytes(context)
                + self.engine_bytes(context))

    def sequence_bytes(self, context: int) -> int:
        """One sequence's caches: cache_slots(context) KV slots and the recurrent state."""
        return cache_slots(context, self.kv_bucket) * self.kv_bytes_per_token + self.state_bytes

    def total_bytes(self, context: int, sequences: int = 1) -> int:
        return self.shared_bytes(context) + sequences * self.sequence_bytes(context)

    def max_context_tokens(self, free_bytes: int) -> int:
        """The longest context limit whose engine (weights included) fits in free_bytes; 0 if none."""
        if self.total_bytes(1) > free_bytes:
            return 0
        lo, hi = 1, 2
        while self.total_bytes(hi) <= free_bytes:  # bytes grow with the context: bracket, then bisect
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.total_bytes(mid) <= free_bytes else (lo, mid)
        return lo

    def max_sequences(self, free_bytes: int, context_tokens: int) -> int:
        """How many sequences' caches of `context_tokens` fit beside the shared bytes; 0 if none."""
        room = free_bytes - self.shared_bytes(context_tokens)
        return max(room // self.sequence_bytes(context_tokens), 0)


def max_context_tokens(free_bytes: int, target: TargetConfig, drafter: DrafterConfig | None = None, **plan) -> int:
    """PairMemory(target, drafter, **plan).max_context_tokens(free_bytes)."""
    return PairMemory(target, drafter, **plan).max_context_tokens(free_bytes)


def max_sequences(free_bytes: int, context_tokens: int, target: TargetConfig, drafter: DrafterConfig | None = None,
                  **plan) -> int:
    """PairMemory(target, drafter, **plan).max_sequences(free_bytes, context_tokens)."""
    return PairMemory(target, drafter, **plan).max_sequences(free_bytes, context_tokens)


if __name__ == "__main__":
    from ddtree.memory_report import main

    main()
