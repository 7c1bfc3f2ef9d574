"""``ssu new-backend``: a generated distribution installs, is discovered, is selected from a config
file and passes the conformance suite unchanged."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

import ssu
from ssu.cli.main import main
from ssu.cli.scaffold import write_backend


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("Bad_Name", "not valid"),
        ("9lives", "not valid"),
        ("a--b", "not valid"),
        ("flashinfer", "first-party"),
        ("reference", "first-party"),
    ],
)
def test_names_are_checked(tmp_path, name, pattern):
    with pytest.raises(ssu.ConfigError, match=pattern):
        write_backend(name, tmp_path)


def test_existing_folder_is_not_overwritten(tmp_path, capsys):
    assert main(["new-backend", "mine", "--dir", str(tmp_path)]) == 0
    assert main(["new-backend", "mine", "--dir", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["new-backend", "mine", "--dir", str(tmp_path), "--force"]) == 0


def test_generated_files(tmp_path):
    root = write_backend("my-kernel", tmp_path)
    assert (root / "pyproject.toml").read_text().count('my-kernel = "ssu_backend_my_kernel.plugin"') == 1
    for relative in (
        "README.md",
        "ssu_backend_my_kernel/plugin.py",
        "ssu_backend_my_kernel/options.py",
        "tests/test_conformance.py",
    ):
        assert (root / relative).is_file()
    compile((root / "ssu_backend_my_kernel/plugin.py").read_text(), "plugin.py", "exec")


@pytest.mark.parametrize(
    "cuda, options, expected",
    [
        (False, {}, dict(profile="quick", device="cpu", max_examples=None)),
        (True, {}, dict(profile="default", device="cuda", max_examples=None)),
        (False, {"ssu_profile": "default"}, dict(profile="default", device="cpu", max_examples=None)),
        (True, {"ssu_device": "cpu", "ssu_examples": 3}, dict(profile="quick", device="cpu", max_examples=3)),
    ],
)
def test_generated_kit_test_is_quick_on_the_cpu_and_full_one_flag_away(tmp_path, monkeypatch, cuda, options, expected):
    """The generated backend's conformance test runs profile quick on the CPU and default on CUDA;
    ssu's pytest options (``--ssu-profile default``, named in its README) override them."""
    import types

    import torch

    root = write_backend("my-kernel", tmp_path)
    assert "pytest --ssu-profile default" in (root / "README.md").read_text()
    spec = importlib.util.spec_from_file_location("generated_kit_test", root / "tests/test_conformance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []
    monkeypatch.setattr(module, "assert_conformant", lambda name, **kwargs: calls.append((name, kwargs)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    request = types.SimpleNamespace(config=types.SimpleNamespace(getoption=lambda name: options.get(name)))
    module.test_conformance(request)
    assert calls == [("my-kernel", expected)]


def _run(args, **kwargs):
    return subprocess.run(args, capture_output=True, text=True, timeout=900, **kwargs)


@pytest.mark.slow
def test_generated_backend_installs_and_passes_the_suite(tmp_path):
    """The sample third-party backend as a real distribution, installed into a folder of its own
    that the processes using it find on PYTHONPATH (this environment is left as it was)."""
    root = write_backend("sample-thirdparty", tmp_path)
    site = tmp_path / "site"
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    install = _run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", *isolation, "--target", str(site), str(root)]
    )
    assert install.returncode == 0, install.stderr
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    listed = _run([sys.executable, "-m", "ssu.cli.main", "backends", "--json"], env=env)
    assert '"name": "sample-thirdparty"' in listed.stdout and '"status": "available"' in listed.stdout
    (tmp_path / "ssu.toml").write_text('[ssu]\nbackend = "sample-thirdparty"\n')
    chosen = _run(
        [
            sys.executable,
            "-m",
            "ssu.cli.main",
            "run",
            "--config",
            str(tmp_path / "ssu.toml"),
            "--nheads",
            "4",
            "--headdim",
            "8",
            "--dstate",
            "16",
            "--ngroups",
            "2",
            "--layers",
            "2",
            "--steps",
            "2",
        ],
        env=env,
        cwd=tmp_path,
    )
    assert chosen.returncode == 0, chosen.stderr
    assert "backend         sample-thirdparty" in chosen.stdout
    own_tests = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=root, env=env)
    assert own_tests.returncode == 0, own_tests.stdout + own_tests.stderr
    suite = _run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--ssu-backend",
            "sample-thirdparty",
            "--ssu-examples",
            "5",
            "-rs",
        ],
        cwd=tmp_path,
        env=env,
    )
    assert suite.returncode == 0, suite.stdout + suite.stderr
    # the suite alone (not the generated distribution's own tests beside it), every check run but
    # the CUDA-graph one and the two of the engine call forms, which the scaffold does not declare;
    # it declares adopt_state, so `adopted` runs too
    from ssu.testing import CHECK_NAMES

    assert f"{len(CHECK_NAMES) - 3} passed, 3 skipped" in suite.stdout, suite.stdout
    assert "needs a CUDA device" in suite.stdout, suite.stdout
    assert "does not declare the engine call form 'packed'" in suite.stdout, suite.stdout
