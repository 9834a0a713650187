#!/usr/bin/env bash
# Train ddtree's demo pair on one GPU in about 9 minutes: tokenizer + target, then the DFlash drafter,
# then the acceptance measurement on held-out standard-library prompts and the two model cards.
#
#   scripts/train_demo.sh                        # full size on CUDA (about 9 minutes on one H200)
#   DDTREE_DEMO_SMOKE=1 scripts/train_demo.sh    # tiny sizes, a few steps, on CPU: the same pipeline end to end
#
# Writes models/demo-target, models/demo-drafter (each with README.md) and
# benchmarks/results/demo-acceptance.json; a smoke run writes under runs/demo-smoke/ instead.
# Environment: DEVICE (cuda / cpu), CORPUS (a folder of .py files instead of the standard library),
# HELD_OUT (held-out fraction, default 0.02), PYTHON (default: the active virtualenv's python, else
# ./.venv/bin/python as scripts/install.sh makes it, else python3), ROOT (checkpoint folder),
# TARGET_OUT / DRAFT_OUT / EVAL_OUT (outputs), EXTRA_TARGET_ARGS / EXTRA_DRAFT_ARGS (appended to a
# stage's flags; the last of a repeated flag wins, e.g. EXTRA_DRAFT_ARGS="--steps 1000").
# Needs only torch, transformers, tokenizers, safetensors and tqdm; no network. Each stage has a
# --time-limit, so the whole run stays under 10 minutes even on a slower GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
# The python that has ddtree's dependencies: an activated virtualenv, else the README's ./.venv.
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then PY=$VIRTUAL_ENV/bin/python
elif [[ -x .venv/bin/python ]]; then PY=.venv/bin/python
else PY=python3
fi
if ! "$PY" -c "import torch, transformers, tokenizers" 2>/dev/null; then
  echo "scripts/train_demo.sh: $PY lacks torch, transformers or tokenizers: run 'bash scripts/install.sh' first," \
       "or set PYTHON to a python that has them" >&2
  exit 2
fi
DATA=(--held-out-fraction "${HELD_OUT:-0.02}")
[[ -n "${CORPUS:-}" ]] && DATA+=(--corpus "$CORPUS")

if [[ "${DDTREE_DEMO_SMOKE:-0}" == 1 ]]; then
  DEVICE=${DEVICE:-cpu}
  ROOT=${ROOT:-runs/demo-smoke}
  TARGET_OUT=${TARGET_OUT:-$ROOT/demo-target}
  DRAFT_OUT=${DRAFT_OUT:-$ROOT/demo-drafter}
  EVAL_OUT=${EVAL_OUT:-$ROOT/demo-acceptance.json}
  TARGET_ARGS=(--vocab-size 1024 --hidden-size 64 --layers 4 --heads 4 --kv-heads 2 --head-dim 16
               --intermediate-size 128 --seq-len 128 --batch-size 8 --steps 20 --warmup 4 --eval-every 10
               --eval-batches 2 --lr 3e-3 --time-limit 300)
  DRAFT_ARGS=(--layers 2 --block-size 16 --prompt-len 32 --gen-len 64 --sequences 32 --held-out-sequences 8
              --gen-batch-size 32 --anchors 8 --batch-size 8 --steps 20 --warmup 4 --eval-every 10 --lr 3e-3
              --time-limit 300)
  EVAL_ARGS=(--prompts 4 --prompt-tokens 32 --max-tokens 24 --sample-tokens 24)
else
  DEVICE=${DEVICE:-cuda}
  ROOT=${ROOT:-runs/demo}
  TARGET_OUT=${TARGET_OUT:-models/demo-target}
  DRAFT_OUT=${DRAFT_OUT:-models/demo-drafter}
  EVAL_OUT=${EVAL_OUT:-benchmarks/results/demo-acceptance.json}
  # 12.6 M parameters. A stdlib is small (2.8 M tokens in Debian's python3.12 at this vocabulary, 8.6 M in
  # a full 3.11), so the schedule is set in epochs; compiled, ~2 M tokens/s on an H200 (~1 min in all).
  TARGET_ARGS=(--vocab-size 8192 --hidden-size 384 --layers 6 --heads 6 --kv-heads 2 --head-dim 64
               --intermediate-size 1024 --seq-len 512 --batch-size 32 --epochs 6 --warmup 50 --lr 2e-3
               --eval-every 250 --save-every 1000 --eval-batches 16 --compile --time-limit 120)
  # 3.4 M parameters; ~30 steps/s of 64 sequences x 32 blocks x 16 tokens on an H200, after ~1 min of
  # greedy generation for the self-distillation data (~6.5 min in all).
  DRAFT_ARGS=(--layers 2 --block-size 16 --prompt-len 64 --gen-len 192 --sequences 49152
              --held-out-sequences 128 --gen-batch-size 8192 --anchors 32 --batch-size 64 --steps 9000
              --warmup 200 --lr 1e-3 --eval-every 1500 --save-every 3000 --time-limit 450)
  EVAL_ARGS=(--prompts 32 --prompt-tokens 128 --max-tokens 128 --sample-tokens 96)
fi

SCRIPT_CMD="scripts/train_demo.sh"
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
