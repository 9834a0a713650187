"""Start-up mistakes on the command line: one line on stderr, exit code 2, nothing on stdout, and
nothing heavy imported (no torch, no server, no transformers) -- so each is refused in well
under a second, and `serve` never opens its port.

Every case runs the real command in a subprocess through a small driver that reports any heavy
module it finds imported after `ddtree.cli.main` returns.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ddtree.version import package_version
from server_process import free_port, quiet_env

REPO = Path(__file__).resolve().parent.parent

HEAVY = ("torch", "transformers", "uvicorn", "fastapi")
DRIVER = ("import sys\n"
          "from ddtree.cli import main\n"
          "code = main(sys.argv[1:])\n"
          f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
          "if heavy:\n"
          "    print('imported: ' + ', '.join(heavy))\n"
          "sys.exit(code)\n")


def run_cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DRIVER, *argv], capture_output=True, text=True, timeout=60,
                          env={**quiet_env(), **(env or {})})


def assert_refused(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.stdout == "", f"stdout must be empty (a heavy import shows here): {proc.stdout!r}"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {proc.stderr!r}"
    assert lines[0].startswith("ddtree: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    assert proc.returncode == 2, proc.returncode
    return lines[0]


@pytest.fixture(scope="module")
def empty_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("not-a-model")


MISTAKES = {
    # name: (argv, fragments of the error line)
    **{f"generate-device-{d}": (["generate", "--device", d], ["--device", repr(d)])
       for d in ("tpu", "CPU", "mps", "xpu", "meta")},
    "generate-device-cpu-index": (["generate", "--device", "cpu:1"], ["--device"]),
    "serve-device-tpu": (["serve", "--device", "tpu"], ["--device", "'tpu'"]),
    "serve-device-meta": (["serve", "--device", "meta"], ["--device", "'meta'"]),
    "bench-device-mps": (["bench", "--offline", "--device", "mps"], ["--device", "'mps'"]),
    "tune-device-xpu": (["tune", "--device", "xpu"], ["--device", "'xpu'"]),
    "train-drafter-device-gpu": (["train-drafter", "--target", "t", "--out", "o", "--device", "gpu"], ["--device"]),
    "serve-port-too-large": (["serve", "--port", "99999"], ["--port", "99999"]),
    "serve-port-negative": (["serve", "--port", "-1"], ["--port", "-1"]),
    "serve-port-text": (["serve", "--port", "http"], ["--port", "'http'"]),
    "serve-bad-log-level": (["serve", "--log-level", "loud"], ["--log-level", "loud"]),
    "serve-bad-tree-budget": (["serve", "--tree-budget", "wide"], ["tree budget", "wide"]),
    "serve-budget-without-drafter": (["serve", "--target", "{empty}", "--tree-budget", "16"],
                                     ["tree budget 16 needs a drafter", "--draft"]),
    "serve-target-without-config": (["serve", "--target", "{empty}"], ["config.json"]),
    "serve-missing-target": (["serve", "--target", "{empty}/missing"], ["--target", "no such directory"]),
    "serve-context-over-the-target": (["serve", "--max-model-len", "100000"], ["max_model_len", "100000"]),
    "serve-drafter-is-a-target": (["serve", "--draft", "{repo}/models/demo-target"], ["DFlashDraftModel"]),
    "serve-max-request-bytes": (["serve", "--max-request-bytes", "0"], ["--max-request-bytes"]),
    "generate-max-model-len-one": (["generate", "--max-model-len", "1"], ["--max-model-len"]),
    "generate-bad-dtype": (["generate", "--dtype", "fp8"], ["--dtype", "fp8"]),
    "generate-top-k-below-minus-one": (["generate", "--top-k", "-2"], ["--top-k", "-2"]),
    "generate-budget-without-drafter": (["generate", "--target", "{repo}/models/demo-drafter", "--tree-budget", "chain"],
                                        ["tree budget chain needs a drafter"]),
    "generate-unknown-flag": (["generate", "--frobnicate", "5"], ["unrecognized arguments", "--frobnicate"]),
    "bench-without-a-backend": (["bench"], ["--base-url", "--offline"]),
    "bench-negative-timeout": (["bench", "--base-url", "http://127.0.0.1:9", "--request-timeout", "-1"],
                               ["--request-timeout"]),
    "bench-target-without-drafter": (["bench", "--offline", "--target", "{repo}/models/demo-drafter"],
                                     ["need a drafter", "--tree-budgets ar"]),
    "tune-target-without-drafter": (["tune", "--target", "{repo}/models/demo-drafter"], ["tune needs a drafter"]),
    "no-command": ([], ["command"]),
    "unknown-command": (["server"], ["server"]),
}


@pytest.mark.parametrize("case", list(MISTAKES))
def test_start_up_mistake_is_one_line_and_exit_2(case, empty_dir):
    argv, fragments = MISTAKES[case]
    argv = [a.replace("{empty}", str(empty_dir)).replace("{repo}", str(REPO)) for a in argv]
    if argv and argv[0] == "serve":
        argv += ["--port", str(free_port())] if "--port" not in argv else []
    assert_refused(run_cli(*argv), *fragments)


def test_port_from_the_environment_is_checked_too():
    assert_refused(run_cli("serve", env={"DDTREE_PORT": "99999"}), "--port", "99999")


def test_rope_scaling_from_the_environment_is_checked_too():
    """DDTREE_ROPE_SCALING is read as --rope-scaling is, and a rope type ddtree lacks is refused
    before anything loads."""
    assert_refused(run_cli("serve", "--port", str(free_port()), env={"DDTREE_ROPE_SCALING": "[4]"}),
                   "--rope-scaling", "JSON object")
    assert_refused(run_cli("serve", "--port", str(free_port()),
                           env={"DDTREE_ROPE_SCALING": '{"rope_type": "longrope"}'}), "longrope", "not supported")


def test_cuda_without_a_gpu_is_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = run_cli("generate", "--device", "cuda")
    assert proc.stdout.startswith("imported: torch") or proc.stdout == ""  # torch is what answers the question
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "no CUDA GPU" in lines[0]


def test_version():
    proc = subprocess.run([sys.executable, "-m", "ddtree.cli", "--version"], capture_output=True, text=True,
                          timeout=60, env=quiet_env())
    assert proc.returncode == 0 and proc.stdout.strip() == f"ddtree {package_version()}"
    assert package_version().count(".") >= 2


def test_python_api_refuses_a_device_it_cannot_run_on():
    from ddtree.config import DDTreeError
    from ddtree.llm import LLM

    for device in ("tpu", "CPU", "mps", "meta"):
        with pytest.raises(DDTreeError, match="device must be cpu, cuda or cuda:N"):
            LLM(device=device)

