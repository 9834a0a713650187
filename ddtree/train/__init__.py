"""Training: a byte-level BPE tokenizer and a small Qwen3 target (`ddtree train-target`), and a DFlash
drafter for any target the engine loads (`ddtree train-drafter`). See docs/training.md."""
