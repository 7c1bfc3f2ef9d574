"""benchmarks/engine_shapes.py without a GPU: the engine's kernel read out of its wheel and the
triton backend in pinned launch shapes, in Triton's interpreter, each contender checked against
the engine's kernel before it is timed (wall-clock times that mean nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import engine_kernels as wheels

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "engine_shapes.py"


@pytest.mark.slow
def test_pinned_shapes_beside_the_engines_kernel():
    found = wheels.wheel(*wheels.VLLM)
    if found is None:
        pytest.skip(wheels.missing(*wheels.VLLM))
    args = ["--device", "cpu", "--engine-wheel", str(found), "--engines", "vllm", "--forms", "speculative",
            "--state-dtype", "fp32", "--batches", "1", "--rounds", "1", "--iterations", "1",
            "--calls", "4:1:1:1,4:1:0:0"]  # fmt: skip
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("vllm speculative fp32 b1:"))
    assert "vllm " in line and " triton " in line and " c4:1:1:1 " in line and " c4:1:0:0 " in line
    assert "MISMATCH" not in result.stdout
