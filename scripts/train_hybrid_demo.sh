#!/usr/bin/env bash
# Train a small hybrid target (Qwen3.5 architecture: Gated DeltaNet + gated attention, 3:1) and its
# DFlash drafter on one GPU in about 10 minutes, then measure their acceptance on held-out
# standard-library prompts and write the two model cards. The shipped dense demo pair
# (models/demo-*, scripts/train_demo.sh) stays the default of every command; this pair is for
# measuring DDTree on a hybrid target.
#
#   scripts/train_hybrid_demo.sh                        # full size on CUDA (stage limits 120 + 420 s, then the evaluation)
#   DDTREE_DEMO_SMOKE=1 scripts/train_hybrid_demo.sh    # tiny sizes, a few steps, on CPU: the same pipeline end to end
#
# Writes runs/hybrid-demo/{hybrid-target,hybrid-drafter} (each with README.md) and
# runs/hybrid-demo/hybrid-acceptance.json; a smoke run writes under runs/hybrid-demo-smoke/.
# Environment, as for scripts/train_demo.sh: DEVICE (cuda / cpu), CORPUS (a folder of .py files instead
# of the standard library), HELD_OUT (held-out fraction, default 0.02), PYTHON (default .venv/bin/python
# when present, else python3), ROOT (outputs and checkpoints), TARGET_OUT / DRAFT_OUT / EVAL_OUT,
# EXTRA_TARGET_ARGS / EXTRA_DRAFT_ARGS (appended to a stage's flags; the last of a repeated flag wins).
# Needs only torch, transformers (with its qwen3_5 models), tokenizers, safetensors and tqdm; no network.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON; elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
DATA=(--held-out-fraction "${HELD_OUT:-0.02}")
[[ -n "${CORPUS:-}" ]] && DATA+=(--corpus "$CORPUS")

if [[ "${DDTREE_DEMO_SMOKE:-0}" == 1 ]]; then
  DEVICE=${DEVICE:-cpu}
  ROOT=${ROOT:-runs/hybrid-demo-smoke}
  # 4 layers: 3 Gated DeltaNet, then 1 full attention.
  TARGET_ARGS=(--arch qwen3_5 --vocab-size 1024 --hidden-size 64 --layers 4 --heads 4 --kv-heads 2 --head-dim 16
               --linear-key-heads 2 --linear-value-heads 4 --linear-head-dim 16 --intermediate-size 128
               --seq-len 128 --batch-size 8 --steps 20 --warmup 4 --eval-every 10 --eval-batches 2 --lr 3e-3
               --time-limit 300)
  DRAFT_ARGS=(--layers 2 --block-size 16 --prompt-len 32 --gen-len 64 --sequences 32 --held-out-sequences 8
              --gen-batch-size 32 --anchors 8 --batch-size 8 --steps 20 --warmup 4 --eval-every 10 --lr 3e-3
              --time-limit 300)
  EVAL_ARGS=(--prompts 4 --prompt-tokens 32 --max-tokens 24 --sample-tokens 24)
else
  DEVICE=${DEVICE:-cuda}
  ROOT=${ROOT:-runs/hybrid-demo}
  # About 17 M parameters: 8 layers (6 Gated DeltaNet, 2 full attention), hidden 384, the demo
  # target's attention shape, Gated DeltaNet keys of hidden / 2 and values of hidden (Qwen3.5's
  # proportions). Not compiled: transformers runs its PyTorch Gated DeltaNet where the
  # flash-linear-attention kernels are absent. Set in epochs, like the dense demo; the time limit
  # cuts the schedule short on a slow machine.
  TARGET_ARGS=(--arch qwen3_5 --vocab-size 8192 --hidden-size 384 --layers 8 --heads 6 --kv-heads 2 --head-dim 64
               --linear-key-heads 3 --linear-value-heads 6 --linear-head-dim 64 --full-attention-interval 4
               --conv-kernel 4 --intermediate-size 1024 --seq-len 512 --batch-size 32 --epochs 4 --warmup 50
               --lr 2e-3 --eval-every 250 --save-every 1000 --eval-batches 16 --time-limit 120)
  # The dense demo's drafter recipe on two thirds of its data and steps: the hybrid target's
  # generation and feature passes cost more than the dense target's.
  DRAFT_ARGS=(--layers 2 --block-size 16 --prompt-len 64 --gen-len 192 --sequences 32768
              --held-out-sequences 128 --gen-batch-size 4096 --anchors 32 --batch-size 64 --steps 6000
              --warmup 200 --lr 1e-3 --eval-every 1500 --save-every 3000 --time-limit 420)
  EVAL_ARGS=(--prompts 32 --prompt-tokens 128 --max-tokens 128 --sample-tokens 96)
fi
TARGET_OUT=${TARGET_OUT:-$ROOT/hybrid-target}
DRAFT_OUT=${DRAFT_OUT:-$ROOT/hybrid-drafter}
EVAL_OUT=${EVAL_OUT:-$ROOT/hybrid-acceptance.json}

SCRIPT_CMD="scripts/train_hybrid_demo.sh"
for var in EXTRA_DRAFT_ARGS EXTRA_TARGET_ARGS DDTREE_DEMO_SMOKE; do
  [[ -n "${!var:-}" ]] && SCRIPT_CMD="$var=${!var@Q} $SCRIPT_CMD"
done

$PY -m ddtree.train.cli train-target --out "$TARGET_OUT" --checkpoint-dir "$ROOT/target-checkpoint" \
  --device "$DEVICE" --seed 0 "${DATA[@]}" "${TARGET_ARGS[@]}" ${EXTRA_TARGET_ARGS:-}
$PY -m ddtree.train.cli train-drafter --target "$TARGET_OUT" --out "$DRAFT_OUT" \
  --checkpoint-dir "$ROOT/drafter-checkpoint" --device "$DEVICE" --seed 0 "${DATA[@]}" "${DRAFT_ARGS[@]}" \
  ${EXTRA_DRAFT_ARGS:-}
$PY -m ddtree.train.evaluate --target "$TARGET_OUT" --draft "$DRAFT_OUT" --out "$EVAL_OUT" \
  --device "$DEVICE" --budgets chain,64 "${DATA[@]}" "${EVAL_ARGS[@]}"
$PY -m ddtree.train.model_card --target "$TARGET_OUT" --draft "$DRAFT_OUT" --eval "$EVAL_OUT" \
  --script "$SCRIPT_CMD"
