"""Model configurations read from Hugging Face / z-lab `config.json` files, validated."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ddtree.config import DDTreeError

TARGET_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
}
TARGET_MODEL_TYPES = {"qwen3": "qwen3", "llama": "llama", "mistral": "llama"}
# Hybrid targets (Gated DeltaNet + gated attention): the multimodal checkpoint's text model
# (`text_config`, weights `model.language_model.*`) or the text-only causal LM (`model.*`).
HYBRID_ARCHITECTURES = {"Qwen3_5ForConditionalGeneration": "qwen3_5", "Qwen3_5ForCausalLM": "qwen3_5"}
HYBRID_MODEL_TYPES = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5"}
# Refused with a one-line error: mixture-of-experts hybrids need expert layers ddtree does not have.
UNSUPPORTED_MODEL_TYPES = {"qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "qwen3_moe"}
SUPPORTED_TARGETS = "Qwen3ForCausalLM, LlamaForCausalLM, MistralForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5ForCausalLM"
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise DDTreeError(f"{what}: missing file {path}")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DDTreeError(f"{what}: cannot parse {path}: {exc}") from None
    if not isinstance(data, dict):
        raise DDTreeError(f"{what}: {path} does not hold a JSON object")
    return data


def _require(cfg: dict, key: str, kind: type, what: str):
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise DDTreeError(f"{what}: config.json field '{key}' is missing or not a {kind.__name__} (got {value!r})")
    return value


def _number(value, kind: type, field_name: str, what: str):
    """int(value) / float(value) for a config field, or a DDTreeError naming the field."""
    if isinstance(value, bool):
        raise DDTreeError(f"{what}: config field '{field_name}' must be a number, got {value!r}")
    try:
        number = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise DDTreeError(f"{what}: config field '{field_name}' must be a number, got {value!r}") from None
    if kind is int and number != value:
        raise DDTreeError(f"{what}: config field '{field_name}' must be an integer, got {value!r}")
    return number


@dataclass
class RopeConfig:
    """Rotary embedding settings, read as transformers reads them: theta plus optional scaling
    (`default`, `linear`, `llama3`, or `yarn`: YaRN's static form, as vLLM applies it, the same
    frequencies at every length). For YaRN, `attention_factor` is the one cos and sin are
    multiplied by (transformers' `attention_scaling`), resolved here from `factor`, `mscale` and
    `mscale_all_dim` when the config does not give it."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192  # from_hf: the config's, else max_position_embeddings
    partial_rotary_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    @classmethod
    def from_hf(cls, cfg: dict, what: str, default_partial: float = 1.0) -> "RopeConfig":
        # transformers 5 writes `rope_parameters`; 4.x writes `rope_theta` + `rope_scaling`.
        params = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        if isinstance(scaling, dict):
            params = {**scaling, **params}
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise DDTreeError(f"{what}: rope type '{rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        max_positions = _number(cfg.get("max_position_embeddings", 4096), int, "max_position_embeddings", what)
        # llama3 and YaRN scale against the length the model was pretrained at: the config's field
        # (top level first, as Phi-3 writes it), else max_position_embeddings, as transformers reads it.
        original = cfg.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
        original = _number(max_positions if original is None else original, int, "original_max_position_embeddings",
                           what)
        factor = params.get("factor")
        if factor is None:  # YaRN without one (DeepSeek-V3's form): the lengths' ratio
            factor = max_positions / original if rope_type == "yarn" else 1.0
        factor = _number(factor, float, "rope factor", what)
        if factor <= 0 or original < 1:
            raise DDTreeError(f"{what}: rope factor and original_max_position_embeddings must be positive, "
                              f"got {factor} and {original}")
        rope = cls(
            theta=_number(theta, float, "rope_theta", what),
            rope_type=rope_type,
            factor=factor,
            low_freq_factor=_number(params.get("low_freq_factor", 1.0), float, "low_freq_factor", what),
            high_freq_factor=_number(params.get("high_freq_factor", 4.0), float, "high_freq_factor", what),
            original_max_position_embeddings=original,
            partial_rotary_factor=_number(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_partial)),
                                          float, "partial_rotary_factor", what),
            beta_fast=_number(params.get("beta_fast") or 32, float, "beta_fast", what),
            beta_slow=_number(params.get("beta_slow") or 1, float, "beta_slow", what),
            truncate=bool(params.get("truncate", True)),
        )
        if rope_type == "yarn":
            rope.attention_factor = _yarn_attention_factor(params, factor, what)
        return rope

    def context_limit(self, max_position_embeddings: int) -> int:
        """The longest context these settings serve, as vLLM derives it: YaRN's pretrained length
        times its factor, linear scaling's max_position_embeddings times its factor, else
        max_position_embeddings (llama3 configs already give the extended length there)."""
        if self.rope_type == "yarn":
            return int(self.original_max_position_embeddings * self.factor)
        if self.rope_type == "linear":
            return int(max_position_embeddings * self.factor)
        return max_position_embeddings


def override_rope(cfg: dict, rope: dict) -> None:
    """Put `rope` (a rope type and its settings) over cfg's rope settings, in place: merged into
    `rope_parameters` where the config has them (transformers 5, whose rope_theta is there), else
    into `rope_scaling`. A legacy "type" key counts as "rope_type"."""
    rope = dict(rope)
    if "type" in rope:
        rope.setdefault("rope_type", rope.pop("type"))
    key = "rope_parameters" if isinstance(cfg.get("rope_parameters"), dict) else "rope_scaling"
    old = cfg.get(key) if isinstance(cfg.get(key), dict) else {}
    cfg[key] = {**{k: v for k, v in old.items() if k != "type"}, **rope}


def _yarn_attention_factor(params: dict, factor: float, what: str) -> float:
    """YaRN's cos/sin multiplier: the config's `attention_factor`, else 0.1 ln(factor) + 1 (scaled
    by `mscale` over `mscale_all_dim` where both are given, DeepSeek's form)."""
    if params.get("attention_factor") is not None:
        value = _number(params["attention_factor"], float, "attention_factor", what)
        if value <= 0:
            raise DDTreeError(f"{what}: rope attention_factor must be positive, got {value}")
        return value

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, _number(m, float, "mscale", what)) / mscale(factor, _number(m_all, float, "mscale_all_dim", what))
    return mscale(factor)


@dataclass
class TransformerConfig:
    """Fields shared by the target and the drafter (both are Qwen3/Llama-shaped stacks)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @property
    def context_limit(self) -> int:
        """The longest context the config serves: max_position_embeddings, extended by rope scaling
        (`RopeConfig.context_limit`)."""
        return self.rope.context_limit(self.max_position_embeddings)

    @staticmethod
    def common_fields(cfg: dict, what: str, default_partial_rotary: float = 1.0) -> dict:
        hidden = _require(cfg, "hidden_size", int, what)
        layers = _require(cfg, "num_hidden_layers", int, what)
        heads = _require(cfg, "num_attention_heads", int, what)
        kv_heads = _number(cfg.get("num_key_value_heads") or heads, int, "num_key_value_heads", what)
        for name, value in (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads),
                            ("num_key_value_heads", kv_heads)):
            if value < 1:
                raise DDTreeError(f"{what}: config field '{name}' must be >= 1, got {value}")
        head_dim = _number(cfg.get("head_dim") or hidden // heads, int, "head_dim", what)
        if head_dim < 2 or head_dim % 2:
            raise DDTreeError(f"{what}: head_dim must be an even number >= 2, got {head_dim}")
        if heads % kv_heads:
            raise DDTreeError(f"{what}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        return dict(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=_require(cfg, "intermediate_size", int, what),
            vocab_size=_require(cfg, "vocab_size", int, what),
            rms_norm_eps=_number(cfg.get("rms_norm_eps", 1e-6), float, "rms_norm_eps", what),
            rope=RopeConfig.from_hf(cfg, what, default_partial_rotary),
            max_position_embeddings=_number(cfg.get("max_position_embeddings", 4096), int, "max_position_embeddings", what),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
        )


@dataclass
class GatedDeltaNetConfig:
    """A hybrid target's linear-attention (Gated DeltaNet) layers: key/query heads, value heads
    (a multiple of the key heads), their dims and the causal conv's kernel length."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: query, key and value projections side by side."""
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_hf(cls, cfg: dict, what: str) -> "GatedDeltaNetConfig":
        out = cls(
            num_key_heads=_number(cfg.get("linear_num_key_heads", 16), int, "linear_num_key_heads", what),
            num_value_heads=_number(cfg.get("linear_num_value_heads", 32), int, "linear_num_value_heads", what),
            key_head_dim=_number(cfg.get("linear_key_head_dim", 128), int, "linear_key_head_dim", what),
            value_head_dim=_number(cfg.get("linear_value_head_dim", 128), int, "linear_value_head_dim", what),
            conv_kernel=_number(cfg.get("linear_conv_kernel_dim", 4), int, "linear_conv_kernel_dim", what),
        )
        for name in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"):
            if getattr(out, name) < 1:
                raise DDTreeError(f"{what}: config field 'linear_{name}' must be >= 1, got {getattr(out, name)}")
        if out.conv_kernel < 2:
            raise DDTreeError(f"{what}: linear_conv_kernel_dim must be >= 2, got {out.conv_kernel}")
        if out.num_value_heads % out.num_key_heads:
            raise DDTreeError(f"{what}: linear_num_value_heads {out.num_value_heads} is not a multiple of "
                              f"linear_num_key_heads {out.num_key_heads}")
        return out


LAYER_KINDS = ("full_attention", "linear_attention")


@dataclass
class TargetConfig(TransformerConfig):
    architecture: str = "qwen3"  # "qwen3" (q/k norms), "llama", or "qwen3_5" (hybrid)
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    # Hybrid targets only: each layer's kind ("full_attention" / "linear_attention"), the linear
    # layers' shape, and whether the checkpoint nests the text model (`model.language_model.*`).
    layer_types: list[str] = field(default_factory=list)
    gdn: GatedDeltaNetConfig | None = None
    nested_text_model: bool = False

    @property
    def hybrid(self) -> bool:
        return self.gdn is not None

    @property
    def attention_layers(self) -> list[int]:
        """Indices of the layers that keep a KV cache."""
        if not self.hybrid:
            return list(range(self.num_hidden_layers))
        return [i for i, kind in enumerate(self.layer_types) if kind == "full_attention"]

    @classmethod
    def from_dir(cls, path: str | Path, rope_scaling: dict | None = None) -> "TargetConfig":
        """The target's config.json, with `rope_scaling` (`--rope-scaling`) over its rope settings."""
        path = Path(path)
        what = f"target model {path}"
        if not path.is_dir():
            raise DDTreeError(f"{what}: not a directory")
        cfg = read_json(path / "config.json", what)
        archs = [a for a in cfg.get("architectures") or [] if isinstance(a, str)]
        model_type = cfg.get("model_type", "")
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None
        if rope_scaling is not None:
            override_rope(text if text is not None else cfg, rope_scaling)
        types = {model_type, (text or {}).get("model_type", "")}
        if types & UNSUPPORTED_MODEL_TYPES or any("Moe" in a or "Qwen3Next" in a for a in archs):
            raise DDTreeError(f"{what}: architecture {archs or model_type} (mixture of experts) is not supported "
                              f"(supported: {SUPPORTED_TARGETS})")
        hybrid = next((HYBRID_ARCHITECTURES[a] for a in archs if a in HYBRID_ARCHITECTURES), None)
        hybrid = hybrid or HYBRID_MODEL_TYPES.get(model_type)
        if hybrid is not None:
            return cls._hybrid(path, cfg, text, what)
        arch = None
        for name in archs:
            arch = arch or TARGET_ARCHITECTURES.get(name)
        arch = arch or TARGET_MODEL_TYPES.get(model_type)
        if arch is None:
            raise DDTreeError(
                f"{what}: architecture {cfg.get('architectures') or model_type} is not supported "
                f"(supported: {SUPPORTED_TARGETS})"
            )
        fields = cls.common_fields(cfg, what)
        eos = _eos_ids(path, cfg)
        return cls(
            **fields,
            qk_norm=arch == "qwen3",
            architecture=arch,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            eos_token_ids=eos,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    @classmethod
    def _hybrid(cls, path: Path, cfg: dict, text: dict | None, what: str) -> "TargetConfig":
        """Qwen3.5 / Qwen3.6: the text model's fields (under `text_config` in the multimodal
        checkpoint); rotary on a quarter of each head unless the config says otherwise."""
        fields_cfg = text if text is not None else cfg
        fields = cls.common_fields(fields_cfg, what, default_partial_rotary=0.25)
        layers = fields["num_hidden_layers"]
        interval = _number(fields_cfg.get("full_attention_interval", 4), int, "full_attention_interval", what)
        layer_types = fields_cfg.get("layer_types") or [
            "full_attention" if (i + 1) % max(interval, 1) == 0 else "linear_attention" for i in range(layers)]
        if (not isinstance(layer_types, list) or len(layer_types) != layers
                or any(t not in LAYER_KINDS for t in layer_types)):
            raise DDTreeError(f"{what}: layer_types must list 'full_attention'/'linear_attention' for each of {layers} layers")
        act = fields_cfg.get("hidden_act", "silu")
        if act != "silu":
            raise DDTreeError(f"{what}: hidden_act '{act}' is not supported (supported: silu)")
        tie = cfg.get("tie_word_embeddings", fields_cfg.get("tie_word_embeddings", False))
        eos_source = dict(cfg)
        if eos_source.get("eos_token_id") is None and text is not None:
            eos_source["eos_token_id"] = text.get("eos_token_id")
        return cls(
            **fields,
            qk_norm=True,
            architecture="qwen3_5",
            tie_word_embeddings=bool(tie),
            eos_token_ids=_eos_ids(path, eos_source),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype") or fields_cfg.get("dtype"),
            layer_types=list(layer_types),
            gdn=GatedDeltaNetConfig.from_hf(fields_cfg, what),
            nested_text_model=text is not None,
        )


def _eos_ids(path: Path, cfg: dict) -> list[int]:
    gen_path = path / "generation_config.json"
    source = cfg.get("eos_token_id")
    if gen_path.is_file():
        gen = read_json(gen_path, f"target model {path}")
        if gen.get("eos_token_id") is not None:
            source = gen["eos_token_id"]
    if source is None:
        return []
    ids = source if isinstance(source, list) else [source]
    return [int(i) for i in ids]


@dataclass
class DrafterConfig(TransformerConfig):
    """A z-lab DFlash drafter: a Qwen3-shaped stack reading target features at `target_layer_ids`."""

    block_size: int = 16
    num_target_layers: int = 0
    target_layer_ids: list[int] = field(default_factory=list)
    mask_token_id: int = 0
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> "DrafterConfig":
        path = Path(path)
        what = f"drafter {path}"
        if not path.is_dir():
            raise DDTreeError(f"{what}: not a directory")
        cfg = read_json(path / "config.json", what)
        archs = cfg.get("architectures") or []
        if "DFlashDraftModel" not in archs:
            raise DDTreeError(f"{what}: config.json architectures {archs} is not ['DFlashDraftModel']")
        dflash = cfg.get("dflash_config") or {}

        def pick(name, default=None):
            return dflash.get(name, cfg.get(name, default))

        fields = cls.common_fields(cfg, what)
        layers = fields["num_hidden_layers"]
        num_target_layers = pick("num_target_layers")
        if not isinstance(num_target_layers, int) or num_target_layers < 1:
            raise DDTreeError(f"{what}: config.json field 'num_target_layers' is missing or invalid")
        layer_ids = pick("target_layer_ids") or build_target_layer_ids(num_target_layers, layers)
        if not isinstance(layer_ids, list) or not layer_ids:
            raise DDTreeError(f"{what}: dflash_config.target_layer_ids must be a non-empty list of integers")
        layer_ids = [_number(i, int, "target_layer_ids", what) for i in layer_ids]
        mask_token_id = pick("mask_token_id")
        if not isinstance(mask_token_id, int):
            raise DDTreeError(f"{what}: dflash_config.mask_token_id is missing or not an integer")
        layer_types = cfg.get("layer_types") or ["full_attention"] * layers
        if len(layer_types) != layers or any(t not in ("full_attention", "sliding_attention") for t in layer_types):
            raise DDTreeError(f"{what}: layer_types must list 'full_attention'/'sliding_attention' for each of {layers} layers")
        block_size = _number(pick("block_size", 16), int, "block_size", what)
        if block_size < 2:
            raise DDTreeError(f"{what}: block_size must be >= 2, got {block_size}")
        softcap = pick("final_logit_softcapping")
        window = cfg.get("sliding_window")
        if "sliding_attention" in layer_types and window is not None:
            window = _number(window, int, "sliding_window", what)
            if window < 1:
                raise DDTreeError(f"{what}: sliding_window must be >= 1, got {window}")
        return cls(
            **fields,
            qk_norm=True,
            block_size=block_size,
            num_target_layers=num_target_layers,
            target_layer_ids=layer_ids,
            mask_token_id=mask_token_id,
            layer_types=list(layer_types),
            sliding_window=window,
            input_embedding_scale=_number(pick("input_embedding_scale", 1.0), float, "input_embedding_scale", what),
            output_multiplier=_number(pick("output_multiplier", 1.0), float, "output_multiplier", what),
            final_logit_softcapping=_number(softcap, float, "final_logit_softcapping", what) if softcap else None,
        )

    def check_against(self, target: TargetConfig, path: str | Path) -> None:
        """Raise if this drafter cannot serve `target` (hidden size, vocab, layer count)."""
        what = f"drafter {path}"
        if self.hidden_size != target.hidden_size:
            raise DDTreeError(f"{what}: hidden_size {self.hidden_size} does not match the target's {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise DDTreeError(f"{what}: vocab_size {self.vocab_size} does not match the target's {target.vocab_size}")
        if self.num_target_layers != target.num_hidden_layers:
            raise DDTreeError(
                f"{what}: num_target_layers {self.num_target_layers} does not match the target's "
                f"num_hidden_layers {target.num_hidden_layers}"
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise DDTreeError(f"{what}: target_layer_ids {bad} are outside the target's {target.num_hidden_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise DDTreeError(f"{what}: mask_token_id {self.mask_token_id} is outside the vocabulary")


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Spread the drafter's feature taps over the target's layers, as z-lab's recipe does."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [round(start + (i * span) / (num_draft_layers - 1)) for i in range(num_draft_layers)]
