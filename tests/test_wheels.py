"""The distributions as a user installs them without this repository: wheels built into a folder
(``scripts/build-wheels``), then two backends installed into a fresh virtual environment from that
folder alone (their third-party needs from the package index first; FlashInfer without its CUDA
dependencies, which listing does not need), and listed by ``ssu``."""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ("ssu_core", "ssu_backend_triton", "ssu_backend_flashinfer", "ssu_backend_flashinfer_replayssm")


def run(*command, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=1200, **kwargs)
    assert result.returncode == 0, (command, result.stdout[-3000:], result.stderr[-3000:])
    return result


def build_wheels(tmp_path_factory, out, **kwargs) -> None:
    """``scripts/build-wheels out``, one build at a time: the builds stage in the source tree's
    folders (setuptools' build/ and *.egg-info), which two at once, in pytest-xdist's processes,
    would share. The lock lies in the folder above pytest's temporary folder of the run, which every
    process of one ``pytest -n N`` run shares."""
    lock = tmp_path_factory.getbasetemp().parent / "ssu-build-wheels.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        run("bash", str(ROOT / "scripts" / "build-wheels"), str(out), **kwargs)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    build_wheels(tmp_path_factory, out, cwd=ROOT)
    return out


def test_the_script_builds_the_four_wheels(wheels):
    built = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    assert built == sorted(DISTRIBUTIONS)
    (triton,) = wheels.glob("ssu_backend_triton-*.whl")
    with zipfile.ZipFile(triton) as wheel:  # the compiled lanes' source, built where it runs
        assert "ssu_backend_triton/csrc/lane.cpp" in wheel.namelist()
        assert "ssu_backend_triton/replay/plugin.py" in wheel.namelist()  # triton-replay's package


@pytest.mark.slow
def test_two_backends_install_from_the_wheels_alone_and_are_listed(wheels, tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv))
    python = str(venv / "bin" / "python")
    # what the backends need from elsewhere, at this environment's versions (found in pip's cache)
    names = ("torch", "triton", "pluggy", "attrs", "numpy", "ninja")
    needs = [f"{name}=={importlib.metadata.version(name)}" for name in names]
    run(python, "-m", "pip", "install", "-q", *needs)
    run(
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        f"flashinfer-python=={importlib.metadata.version('flashinfer-python')}",
    )
    # ssu-core comes from the folder as ssu-backend-triton's dependency
    run(python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels), "ssu-backend-triton")
    # flashinfer-python went in without its own (CUDA) dependencies, which pip would look for
    run(
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--find-links",
        str(wheels),
        "ssu-backend-flashinfer",
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    listed = json.loads(run(python, "-m", "ssu", "backends", "--json", "--device", "cpu", cwd=tmp_path, env=env).stdout)
    found = {b["name"]: b for b in listed["backends"]}
    assert set(found) == {"reference", "triton", "triton-replay", "flashinfer"}
    for name in ("triton", "triton-replay"):  # one distribution, two entry points
        assert found[name]["distribution"] == "ssu-backend-triton" and found[name]["status"] == "unavailable"
    assert found["flashinfer"]["distribution"] == "ssu-backend-flashinfer"
    assert str(ROOT) not in run(python, "-c", "import ssu; print(ssu.__file__)", cwd=tmp_path, env=env).stdout


@pytest.mark.slow
def test_the_script_builds_from_a_bare_environment_into_a_relative_folder(tmp_path, tmp_path_factory):
    """A new virtual environment has pip (and an old setuptools, no wheel): enough, since each wheel
    is built in pip's isolated build environment; the folder is relative to where it was called."""
    venv = tmp_path / "bare"
    run(sys.executable, "-m", "venv", str(venv))
    env = dict(os.environ, PATH=f"{venv / 'bin'}:{os.environ['PATH']}")
    env.pop("VIRTUAL_ENV", None)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    build_wheels(tmp_path_factory, "wheels", cwd=elsewhere, env=env)
    built = sorted(p.name.split("-")[0] for p in (elsewhere / "wheels").glob("*.whl"))
    assert built == sorted(DISTRIBUTIONS)
    assert not (ROOT / "wheels").exists()
