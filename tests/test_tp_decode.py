"""benchmarks/tp_decode.py: ranks stepping their shards agree with one unsharded kernel. On the
CPU (gloo, the reference backend) for the gathering and checking; on two GPUs (marker ``gpu2``)
with every GPU backend, each rank on its own device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tp_decode.py"
SMALL = ["--headdim", "8", "--dstate", "16", "--batch", "4", "--steps", "3", "--timed", "2"]


def tp_decode(*args, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("groups", ["2", "1"])
def test_two_cpu_ranks_agree_with_the_unsharded_layer(groups):
    result = tp_decode(
        "--tp", "2", "--device", "cpu", "--backend", "reference", "--nheads", "8", "--ngroups", groups, *SMALL
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 on cpu: heads 0-3" in result.stdout and "rank 1 on cpu: heads 4-7" in result.stdout
    # within the budgets, not necessarily bit for bit: on some processors torch's CPU softplus rounds
    # a tensor of a shard's size differently from one of the whole layer's (seen on AMD EPYC), so
    # the shards' states may differ from the unsharded ones in their last bits
    assert "OK" in result.stdout and "MISMATCH" not in result.stdout
    assert ("replicated on every rank" in result.stdout) == (groups == "1")


def test_a_shape_that_does_not_split_is_refused():
    result = tp_decode("--tp", "3", "--device", "cpu", "--nheads", "8", *SMALL)
    assert result.returncode == 2 and "nheads=8 does not split over tp=3 ranks" in result.stderr


@pytest.mark.gpu2
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("model", ["nemotron-h-8b", "granite-4.0-h"])
def test_two_gpu_ranks_agree_with_the_unsharded_layer(backend, model):
    pytest.importorskip(f"ssu_backend_{backend}")
    result = tp_decode("--tp", "2", "--model", model, "--backend", backend, "--batch", "16")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 1 on cuda:1" in result.stdout and "OK" in result.stdout
