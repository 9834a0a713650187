"""Shared fixtures: model pairs on disk."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (tests/test_tree_kernels.py). The
# variable is read when Triton and the kernels are first imported, so it is set before anything.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import make_pair_with_tokenizer

REPO = Path(__file__).resolve().parent.parent
DEMO_TARGET = REPO / "models" / "demo-target"
DEMO_DRAFT = REPO / "models" / "demo-drafter"


@pytest.fixture(scope="session")
def demo_pair(tmp_path_factory) -> tuple[Path, Path]:
    """The shipped demo pair when present, else a tiny random pair with a real tokenizer."""
    if (DEMO_TARGET / "config.json").is_file() and (DEMO_DRAFT / "config.json").is_file():
        return DEMO_TARGET, DEMO_DRAFT
    return make_pair_with_tokenizer(tmp_path_factory.mktemp("pair"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (the README's command) runs one worker on a machine with a CUDA GPU: the GPU
    tests, and the kernel tests that take the GPU when there is one, share a single device. On a
    CPU, pytest-xdist's own count (a worker per core)."""
    return 1 if torch.cuda.is_available() else None


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Tiny models run fastest single-threaded, and the suite stays fast on a busy 2-core box."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
