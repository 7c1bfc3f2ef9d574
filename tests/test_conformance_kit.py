"""The conformance kit: passes correct backends, catches wrong ones, runs as a pytest plugin."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

from ssu.plugins.registry import GROUP, Registry
from ssu.testing import CHECK_NAMES, assert_conformant

from broken_backends import BROKEN


def registry_with(*plugins) -> Registry:
    reference = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == "reference"]
    registry = Registry(entry_points=reference, env={})
    for plugin in plugins:
        registry.register(plugin())
    return registry


@pytest.mark.slow
def test_reference_is_conformant():
    assert_conformant("reference")


@pytest.mark.parametrize("broken", BROKEN, ids=[b.NAME for b in BROKEN])
def test_the_kit_catches_a_wrong_backend(broken):
    """Each wrong backend fails, at the default profile, the check that covers its bug."""
    registry = registry_with(broken)
    with pytest.raises(AssertionError, match=f"failed for backend '{broken.NAME}'"):
        assert_conformant(broken.NAME, checks=broken.CAUGHT_BY, registry=registry)


def test_unknown_check_name():
    with pytest.raises(ValueError, match="unknown check"):
        assert_conformant("reference", checks=["stepp"])


def _pytest(*args, env=None, cwd):
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env or os.environ.copy(),
        timeout=1500,
    )


@pytest.mark.slow
def test_pytest_plugin_runs_the_suite_on_reference(tmp_path):
    result = _pytest("--ssu-backend", "reference", "--ssu-examples", "5", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(CHECK_NAMES) - 1} passed, 1 skipped" in result.stdout  # cuda-graph needs a GPU


@pytest.mark.slow
def test_pytest_plugin_runs_the_suite_on_triton_in_the_interpreter(tmp_path):
    """The plugin's wiring for an installed third-party backend in Triton's interpreter: the backend
    loaded by name, --ssu-profile and --ssu-device passed on, a check that passes and one that
    cannot run without CUDA. Every check of the suite on triton at this profile, the same cases,
    runs in backends/triton_ssu/tests/test_triton_cpu.py
    (test_passes_each_check_of_the_kit_at_the_smoke_profile), a test per check; the whole suite
    through the plugin in test_pytest_plugin_runs_the_suite_on_reference."""
    pytest.importorskip("ssu_backend_triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = _pytest(
        "--ssu-backend",
        "triton",
        "--ssu-profile",
        "smoke",
        "--ssu-device",
        "cpu",
        "-k",
        "roundtrip or cuda-graph",
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"1 passed, 1 skipped, {len(CHECK_NAMES) - 2} deselected" in result.stdout


def test_pytest_plugin_is_inactive_without_the_option(tmp_path):
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    result = _pytest(cwd=tmp_path)
    assert result.returncode == 0 and "1 passed" in result.stdout


def test_pytest_plugin_refuses_an_unknown_backend(tmp_path):
    result = _pytest("--ssu-backend", "refrence", cwd=tmp_path)
    assert result.returncode == 4
    assert "did you mean 'reference'" in result.stderr


def test_verify_reports_each_check(capsys):
    from ssu.cli.main import main

    assert main(["verify", "--backend", "reference", "--profile", "quick"]) == 0
    out = capsys.readouterr().out
    assert "profile quick" in out and "0 failed" in out
    for name in CHECK_NAMES:
        assert f"  {name} " in out
    assert re.search(r"ran \d+ cases \(0 at real shapes, [1-9]\d* corners\)", out) and "SKIP  cuda-graph" in out


def test_a_correct_api_1_0_backend_stays_conformant():
    """A backend of plugin API 1.0 (no guards_slots, a commit that trusts its counts) passes every
    check of this core's kit: with validation on, the core guards the ids and the counts for it."""
    from older_backends import ApiOneZero

    registry = registry_with(ApiOneZero)
    assert_conformant(ApiOneZero.NAME, profile="quick", registry=registry)


def test_the_core_guards_an_api_1_0_commit():
    """Counts outside 1..T never reach such a backend's commit: that slot is left as it was and
    kernel.check() names the row; the other rows commit."""
    import torch

    import ssu
    from older_backends import ApiOneZero

    registry = registry_with(ApiOneZero)
    p = ssu.Problem(
        nheads=2,
        headdim=4,
        dstate=8,
        ngroups=1,
        input_dtype="fp32",
        num_slots=6,
        max_batch=3,
        tokens_per_step=2,
        speculative=True,
    )
    kernel = ssu.open(ssu.Config(backend=ApiOneZero.NAME), p, registry=registry)
    state = kernel.allocate_state()
    slots = torch.tensor([4, 1, 2], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    kernel.write_state(state, slots, torch.randn(3, 2, 4, 8, generator=gen))
    before = kernel.read_state(state, slots)
    x, dt, B, C = (torch.randn(3, 2, *s, generator=gen) for s in ((2, 4), (2,), (1, 8), (1, 8)))
    kernel.step(state, x, dt, -torch.rand(2) - 0.5, B, C, slots)
    kernel.commit(state, slots, torch.tensor([3, 0, 2], dtype=torch.int32))
    with pytest.raises(ssu.InputError, match=r"num_accepted\[0\] = 3: outside 1\.\.2"):
        kernel.check()
    after = kernel.read_state(state, slots)
    assert torch.equal(after[:2], before[:2])  # counts 3 and 0: left as they were
    assert not torch.equal(after[2], before[2])  # count 2: committed


def test_the_kit_narrows_to_the_state_dtypes_asked_for():
    """``state_dtypes`` draws every problem of every check in those dtypes only."""
    from ssu.conformance import run_conformance

    reports = run_conformance("reference", profile="quick", checks=["step", "decode"], state_dtypes=["int8"])
    assert [r.status for r in reports] == ["pass", "pass"]
    assert {case.problem.state_dtype for r in reports for case in r.ran} == {"int8"}


def test_a_state_dtype_the_backend_lacks_is_refused_naming_what_it_declares():
    from broken_backends import Bf16PrecisionFp32State

    registry = registry_with(Bf16PrecisionFp32State)
    with pytest.raises(ValueError, match="does not declare state dtype.*int8; it declares fp32"):
        assert_conformant(Bf16PrecisionFp32State.NAME, registry=registry, state_dtypes=["int8"])


@pytest.mark.parametrize(
    "value, message",
    [
        ("int9", "'int9' is not a dtype ssu knows"),
        ("int8,fp64", "--state-dtype: fp64 is not a state cache dtype; use one of fp32, bf16, fp16, int8, fp8_e4m3"),
    ],
)
def test_verify_refuses_a_state_dtype_it_cannot_draw(value, message, capsys):
    from ssu.cli.main import main

    assert main(["verify", "--backend", "reference", "--profile", "smoke", "--state-dtype", value]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    import re

    assert re.search(message, err)
