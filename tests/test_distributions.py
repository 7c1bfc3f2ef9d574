"""Each distribution stands on its own: its tests run with ``pytest`` inside its folder, with only
what it declares (ssu-core's pytest plugin brings the ``gpu`` marker and its skip)."""

from __future__ import annotations

import os
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = sorted(p.parent for p in (ROOT / "backends").glob("*/pyproject.toml"))


@pytest.mark.parametrize("folder", BACKENDS, ids=[p.name for p in BACKENDS])
def test_each_backend_declares_its_test_extra_and_pytest_settings(folder):
    project = tomllib.loads((folder / "pyproject.toml").read_text())
    test = project["project"]["optional-dependencies"]["test"]
    assert any(r.startswith("ssu-core[test]") for r in test) and any(r.startswith("pytest") for r in test)
    assert project["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]
    assert "sys.path" not in (folder / "tests" / "conftest.py").read_text()


@pytest.mark.slow
def test_pytest_inside_one_backend_folder():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT / "backends" / "flashinfer_ssu",
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    last = result.stdout.strip().splitlines()[-1]
    assert "passed" in last and "skipped" in last  # the GPU tests skip without CUDA
    assert "rootdir: " not in result.stdout or "flashinfer_ssu" in result.stdout


def test_core_extras_name_every_backend():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras["all"]) == {"ssu-backend-triton", "ssu-backend-flashinfer", "ssu-backend-flashinfer-replayssm"}
