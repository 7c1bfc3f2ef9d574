"""The repository's shell scripts, run as a user runs them (no GPU needed for these checks)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SETUP = ROOT / "scripts" / "gpu-setup.sh"


def bash(command: str, cwd: Path = ROOT, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=120, env=env or dict(os.environ)
    )


def test_gpu_setup_sourced_without_installing_exports_what_it_found():
    result = bash("source scripts/gpu-setup.sh --no-install; echo rc=$?; echo MAX_JOBS=$MAX_JOBS")
    assert "rc=0" in result.stdout, result.stdout + result.stderr
    assert "gpu-setup: CUDA_HOME=" in result.stdout and "MAX_JOBS=" in result.stdout
    assert "Traceback" not in result.stderr


def test_gpu_setup_says_when_no_cuda_toolkit_is_found(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
    env.update(PATH="/usr/bin:/bin", PYTHON=shutil.which("python3") or "python3", SSU_CUDA_SEARCH=str(tmp_path))
    result = bash("source scripts/gpu-setup.sh --no-install; echo rc=$?; echo CUDA_HOME=${CUDA_HOME:-none}", env=env)
    assert "rc=0" in result.stdout and "CUDA_HOME=none" in result.stdout
    assert "no CUDA toolkit found" in result.stderr and "set CUDA_HOME" in result.stderr


def test_gpu_setup_finds_a_toolkit_in_the_folders_it_searches(tmp_path):
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime.h").write_text("")
    (toolkit / "bin").mkdir()
    (toolkit / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (toolkit / "bin" / "nvcc").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_HOME"}
    env.update(PATH="/usr/bin:/bin", PYTHON=shutil.which("python3") or "python3", SSU_CUDA_SEARCH=f"{tmp_path}/cuda-*")
    result = bash("source scripts/gpu-setup.sh --no-install; echo CUDA_HOME=$CUDA_HOME", env=env)
    assert f"CUDA_HOME={toolkit}" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize(
    "args, cwd, message",
    [
        ("--bogus", ROOT, "unknown option --bogus"),
        ("--find-links", ROOT, "--find-links needs a folder"),
        ("--no-install", Path("/"), "run it from the repository root"),
    ],
)
def test_gpu_setup_refuses_bad_use_with_a_reason(args, cwd, message):
    result = bash(f"source {SETUP} {args}; echo rc=$?", cwd=cwd)
    assert "rc=2" in result.stdout and message in result.stderr


def test_gpu_setup_help_is_its_header():
    result = bash(f"bash {SETUP} --help")
    assert result.returncode == 0 and result.stdout.startswith("Set up a GPU machine")
