"""ssu in SGLang 0.5.23, through SGLang's own plugin loader and hook registry (docs/engines.md, "ssu
in SGLang"): inert without an ssu configuration and outside ``SGLANG_PLUGINS``; with one, SGLang's
decode and verify calls (an EAGLE tree, the cache untouched, every token's state in the buffer)
equal SGLang's own Triton kernel and the float64 oracle, and a Mamba-1 layer's calls go to SGLang's
own kernel; through the scheduler's own ``init_mamba_backend``, the routing holds and a wrong
backend name stops the scheduler."""

from __future__ import annotations

import importlib.util

import pytest

from engine_run import STUBS, scenario

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is None,
    reason="SGLang is not installed here: these tests run in SGLang's own virtual environment (.ci/run builds it)",
)


def test_without_configuration_sglang_keeps_its_own_ssu(tmp_path):
    assert scenario("sglang", tmp_path)["backend"] == "triton"


def test_the_plugin_respects_sglangs_allowlist(tmp_path):
    assert (
        scenario("sglang", tmp_path, SSU_BACKEND="reference", SGLANG_PLUGINS="some_other_plugin")["backend"] == "triton"
    )


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_sglang_calls_run_through_the_configured_backend(tmp_path, backend):
    found = scenario("sglang", tmp_path, SSU_BACKEND=backend, SGLANG_PLUGINS="ssu")
    assert found["backend"] == "ssu" and len(found["calls"]) == 4
    for call in found["calls"]:
        assert max(call["out"]) < 1e-5, call
        assert max(call.get("cache", [0])) < 1e-5 and max(call.get("buffer", [0])) < 1e-5, call
        assert call.get("cache_unchanged", True), call
    announced = [line for line in found["logs"] if "serves SGLang's Mamba2 SSU" in line]
    assert len(announced) == 2 and all(f"backend '{backend}'" in line for line in announced)


def test_a_mamba1_layers_calls_go_to_sglangs_own_kernel(tmp_path):
    found = scenario("sglang-mamba1", tmp_path, SSU_BACKEND="reference")
    assert found["backend"] == "ssu" and found["equal"] == [True, True]
    passed = [line for line in found["logs"] if line.startswith("ssu passes SGLang's decode SSU calls")]
    assert len(passed) == 1 and "to SGLang's own 'triton' backend: A: varies along" in passed[0], passed


@pytest.mark.parametrize("backend", [None, "reference", "refrence"])
def test_the_schedulers_own_initialisation(tmp_path, backend):
    """``Scheduler.init_mamba_backend`` calls the initialisation it bound when its module was
    imported; SGLang's hook registry patches that binding too."""
    env = dict(PYTHONPATH=str(STUBS), SGLANG_PLUGINS="ssu")
    if backend:
        env["SSU_BACKEND"] = backend
    found = scenario("sglang-scheduler", tmp_path, **env)
    if backend is None:
        assert found == {"backend": "triton", "logs": []}
    elif backend == "reference":
        assert found["backend"] == "ssu"
        assert any("in place of SGLang's 'triton' backend (TritonSSUBackend)" in line for line in found["logs"])
    else:
        assert found["error"].startswith("UnknownBackendError: SSU_BACKEND: unknown backend 'refrence'"), found
        assert any("ssu cannot serve SGLang's Mamba2 SSU" in line for line in found["logs"])
