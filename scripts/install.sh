#!/usr/bin/env bash
# Install ddtree into ./.venv on a fresh machine (Python >= 3.10).
#   scripts/install.sh          the package, with the CPU build of PyTorch 2.13
#   scripts/install.sh --test   plus the test dependencies
# On a CUDA machine, install the PyTorch build that matches your driver first; pip keeps it, and
# the package comes with its `fla` extra (flash-linear-attention, a hybrid target's prompts through
# its chunked kernel), except with --test: the tests' Qwen3.5 oracle in transformers would run it too.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
if [[ "${1:-}" == "--test" ]]; then
  python -m pip install -q -e ".[test]"
  # z-lab's reference drafter (a test oracle only); its own pins clash with ours, so no deps.
  python -m pip install -q --no-deps "dflash==0.1.0"
  # Triton, for the CUDA tree-build kernels' tests (on a CPU they run in Triton's interpreter);
  # a CUDA build of PyTorch brings its own, which is kept.
  python -c "import triton" 2>/dev/null || python -m pip install -q "triton==3.6.0"
elif python -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  python -m pip install -q -e ".[fla]"
else
  python -m pip install -q -e .
fi
