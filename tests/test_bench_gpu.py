"""``ssu bench`` on a GPU (marker ``gpu``): a short run over two backends writes the table, the
JSON rows and the plot, and recommends one of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu


def test_a_short_run_over_two_backends_writes_all_outputs(tmp_path):
    pytest.importorskip("ssu_backend_triton")
    pytest.importorskip("matplotlib")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    command = [
        sys.executable,
        "-m",
        "ssu",
        "bench",
        *("--nheads", "32", "--headdim", "64", "--dstate", "128", "--ngroups", "4"),
        *("--backends", "reference,triton", "--batches", "1,16", "--state-dtype", "fp32"),
        *("--out", str(tmp_path)),
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=500)
    assert result.returncode == 0, result.stdout + result.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"bench.txt", "bench.json", "bench.png"}
    data = json.loads((tmp_path / "bench.json").read_text())
    assert {r["backend"] for r in data["rows"]} == {"reference", "triton"}
    assert len(data["rows"]) == 2 * 2 and all(r["us"] > 0 for r in data["rows"])
    assert {r["backend"] for r in data["recommendation"]} <= {"reference", "triton"}
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ssu.toml" in result.stdout
