"""ssu in SGLang 0.5.23, through SGLang's own plugin loader and hook registry (docs/engines.md, "ssu
in SGLang"): inert without an ssu configuration and outside ``SGLANG_PLUGINS``; with one, SGLang's
decode and verify calls (an EAGLE tree, the cache untouched, every token's state in the buffer)
equal SGLang's own Triton kernel and the float64 oracle."""

from __future__ import annotations

import importlib.util

import pytest

from engine_run import scenario

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
