"""Model cards (README.md) for a trained target and drafter, filled in from their `training.json`
and an acceptance report written by `ddtree.train.evaluate`.

    python -m ddtree.train.model_card --target models/demo-target --draft models/demo-drafter \
        --eval benchmarks/results/demo-acceptance.json [--script "scripts/train_demo.sh"]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddtree.config import DDTreeError
from ddtree.models.configs import read_json


def _size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6


def _fmt(value, spec: str = ".3f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "n/a"


def acceptance_table(report: dict) -> str:
    n = report["prompts"]
    rows = ["| tree budget | rounds | mean acceptance length | median tokens/s | outputs identical to ar |",
            "|---|---|---|---|---|"]
    for name, r in report["results"].items():
        rows.append(f"| {name} | {r['rounds']} | {r['mean_acceptance_length']:.2f} "
                    f"| {r['median_tokens_per_second']:.1f} | {r['identical_to_ar']}/{n} |")
    ratios = ", ".join(f"budget {b}: {v:.2f}x" for b, v in report.get("tree_over_chain", {}).items())
    return "\n".join(rows) + (f"\n\nDDTree over the chain's acceptance length: {ratios}." if ratios else "")


def samples_block(report: dict) -> str:
    parts = []
    for s in report.get("samples", []):
        parts.append(f"Prompt `{s['prompt'].splitlines()[0]}` (tree budget {s['tree_budget']}, T = 0, mean acceptance "
                     f"{s['mean_acceptance_length']:.2f}):\n\n```python\n{s['prompt']}{s['completion']}\n```")
    return "\n\n".join(parts)


def history_table(summary: dict, keys: list[str]) -> str:
    rows = ["| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for h in summary.get("eval_history", []):
        rows.append(f"| {h['step']} | " + " | ".join(_fmt(h.get(k)) for k in keys) + " |")
    return "\n".join(rows)


def evaluation_section(report: dict) -> str:
    return f"""## Acceptance on held-out prompts

Measured by the ddtree engine at temperature 0 on {report['prompts']} held-out prompts of {report['prompt_tokens']}
tokens ({report['max_tokens']} new tokens each), on {report['machine']}; acceptance length counts the bonus
token (tokens per target forward). The last column compares each output with plain autoregressive
decoding (`ar`) of the same prompt.

{acceptance_table(report)}

Report: `{report.get('path', '')}` (git {report['git_revision'][:12]}); command: `{report['command']}`.

## Samples

{samples_block(report)}
"""


def architecture(config: dict) -> tuple[str, str]:
    """(what the model is, its shape) from a target's config.json: dense Qwen3 or the Qwen3.5 hybrid."""
    attention = f"{config['num_attention_heads']} heads / {config['num_key_value_heads']} KV heads of {config['head_dim']}"
    tail = f"MLP {config['intermediate_size']}, tied embeddings: {config.get('tie_word_embeddings')}"
    types = config.get("layer_types") or []
    if "linear_attention" not in types:
        return ("Qwen3-architecture causal LM",
                f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, {attention}, {tail}")
    full = types.count("full_attention")
    rotary = (config.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25)
    return ("Qwen3.5-architecture hybrid causal LM (Gated DeltaNet and gated full-attention layers)",
            f"{len(types)} layers ({len(types) - full} Gated DeltaNet, {full} gated full attention), hidden "
            f"{config['hidden_size']}; attention {attention}, rotary on {rotary:.0%} of each head; Gated DeltaNet "
            f"{config['linear_num_key_heads']} key / {config['linear_num_value_heads']} value heads of "
            f"{config['linear_key_head_dim']} / {config['linear_value_head_dim']}, conv kernel "
            f"{config['linear_conv_kernel_dim']}; {tail}")


def target_card(summary: dict, config: dict, folder: Path, report: dict, script: str | None) -> str:
    default_note = " Under `models/demo-target` it is the default target of every ddtree command." \
        if folder.name == "demo-target" else ""
    kind, shape = architecture(config)
    return f"""# {folder.name}

A small {kind} for Python code, trained from scratch by `ddtree train-target`
on {summary['corpus']}. It loads in `transformers.AutoModelForCausalLM` / `AutoTokenizer` unchanged;
its DFlash drafter is `{Path(report['draft']).name}`.{default_note}

| | |
|---|---|
| parameters | {summary['parameters'] / 1e6:.2f} M ({_size_mb(folder):.1f} MB of weights on disk) |
| shape | {shape} |
| tokenizer | byte-level BPE, {config['vocab_size']} tokens; eos `<|endoftext|>`, drafter mask `<|mask|>` |
| training tokens | {summary['train_tokens']:,} in the training files ({summary['tokens_seen']:,} seen) |
| held-out files | {summary['held_out_files']} ({summary['held_out_fraction']:.0%} of files by path hash), {summary['held_out_tokens']:,} tokens |
| steps | {summary['steps']} of {summary['schedule_steps']} (stopped by {summary['stopped_by']}), {summary['train_seconds']} s on {summary['device']} |
| held-out loss | **{_fmt(summary['held_out_loss'], '.4f')}** nats/token |

## Reproduce

{f"The whole pipeline: `{script}`. " if script else ""}This model:

```bash
{summary['command']}
```

Held-out loss during training:

{history_table(summary, ['held_out_loss'])}

{evaluation_section(report)}"""


def drafter_card(summary: dict, config: dict, folder: Path, report: dict, script: str | None) -> str:
    dflash = config["dflash_config"]
    return f"""# {folder.name}

A DFlash block-diffusion drafter (z-lab format) for `{Path(summary['target']).name}`, trained by
`ddtree train-drafter` on the target's own greedy continuations of {summary['distill_sequences']:,} prompts
from {summary['corpus']}. It loads in the ddtree engine and in z-lab's
`dflash.model.DFlashDraftModel.from_pretrained`.

| | |
|---|---|
| parameters | {summary['parameters'] / 1e6:.2f} M ({_size_mb(folder):.1f} MB of weights on disk; embedding and LM head are the target's) |
| shape | {config['num_hidden_layers']} layers, block size {config['block_size']}, target features from layers {dflash['target_layer_ids']}, mask token {dflash['mask_token_id']} |
| training data | {summary['distill_tokens']:,} tokens of self-distillation |
| steps | {summary['steps']} of {summary['schedule_steps']} (stopped by {summary['stopped_by']}), {summary['train_seconds']} s on {summary['device']} |
| held-out loss | **{_fmt(summary['held_out_loss'], '.4f')}** (position-weighted cross-entropy) |
| held-out chain acceptance estimate | {_fmt(summary['held_out_acceptance'], '.2f')} (from the training evaluation) |

## Reproduce

{f"The whole pipeline: `{script}`. " if script else ""}This drafter:

```bash
{summary['command']}
```

Held-out metrics during training:

{history_table(summary, ['held_out_loss', 'held_out_acceptance'])}

{evaluation_section(report)}"""


def write_cards(target: Path, draft: Path, eval_path: Path, script: str | None) -> None:
    report = read_json(eval_path, "acceptance report")
    report["path"] = str(eval_path)
    for folder, card in ((target, target_card), (draft, drafter_card)):
        summary = read_json(folder / "training.json", f"model {folder}")
        config = read_json(folder / "config.json", f"model {folder}")
        (folder / "README.md").write_text(card(summary, config, folder, report, script))
        print(f"wrote {folder / 'README.md'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree.train.model_card", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--eval", required=True, help="JSON written by python -m ddtree.train.evaluate")
    p.add_argument("--script", default=None, help="the script that ran the whole pipeline, named in the cards")
    args = p.parse_args(argv)
    try:
        write_cards(Path(args.target), Path(args.draft), Path(args.eval), args.script)
    except DDTreeError as exc:
        print(f"ddtree: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
