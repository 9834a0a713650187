"""Where a measurement was made: device name, library versions, git revision, model fingerprints.

Nothing here names the host: results files get committed and shared.
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent.parent
FINGERPRINT_BYTES = 1 << 16  # read from each end of each weight file


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device | str) -> str:
    """'NVIDIA H200' for a GPU; 'cpu: <model> x <logical cores>' for the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {cpu_name()} x {os.cpu_count()}"


def machine_info(device: torch.device | str | None = None) -> dict:
    info = {
        "platform": f"{platform.system()} {platform.machine()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
    }
    if device is not None:
        info["device"] = device_name(device)
    return info


def git_revision() -> str | None:
    """HEAD of the checkout ddtree runs from, with '-dirty' when tracked files differ; None outside git."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=10)

    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return None
        dirty = git("diff-index", "--quiet", "HEAD", "--").returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty else "")


def model_fingerprint(model_dir: str | Path) -> str:
    """A short hash of a model directory's config.json and its weight files' names, sizes and first
    and last 64 KiB: cheap for multi-GB checkpoints, and it changes when the weights are retrained."""
    model_dir = Path(model_dir)
    h = hashlib.sha256()
    config = model_dir / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            h.update(f.read(FINGERPRINT_BYTES))
            if size > FINGERPRINT_BYTES:
                f.seek(max(size - FINGERPRINT_BYTES, FINGERPRINT_BYTES))
                h.update(f.read())
    return h.hexdigest()[:16]


def results_path(output: str | None, name: str) -> Path:
    """Where a benchmark script writes its JSON: `output`, or benchmarks/results/<name>_<time>.json;
    the folder is created."""
    path = Path(output or f"benchmarks/results/{name}_{time.strftime('%Y%m%d_%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path
