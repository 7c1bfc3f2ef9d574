"""``ssu bench --engine`` without a GPU: the engines' own kernels read out of their wheels (as on a
GPU machine without the engines) and run in Triton's interpreter beside the reference backend on
the engines' calls, each cell checked against the engine's kernel before it is timed; a backend
that computes something else is reported, not timed; what is missing is said with its remedy."""

from __future__ import annotations

import json

import pytest

import engine_kernels as wheels
from ssu.bench import engine_kernels, engines
from ssu.cli.bench import cmd_bench
from ssu.cli.main import _parser, main

SMALL = ["--nheads", "4", "--headdim", "8", "--dstate", "16", "--ngroups", "2", "--batches", "1,3"]


def _wheel(engine: str) -> str:
    spec = wheels.VLLM if engine == "vllm" else wheels.SGLANG
    found = wheels.wheel(*spec)
    if found is None:
        pytest.skip(wheels.missing(*spec))
    return str(found)


def fake_timer(launches, *, min_launches: int = 1) -> float:
    for fn in launches:
        fn()
    return 10.0 + len(launches)


def bench(args: list) -> int:
    """``ssu bench ARGS`` with the fake timer (each launch run once)."""
    return cmd_bench(_parser().parse_args(args), timer=fake_timer)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_engines_kernel_beside_the_reference_on_its_own_calls(engine, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = ["bench", "--engine", engine, "--engine-wheel", _wheel(engine), "--device", "cpu", "--backends",
            "reference", "--state-dtype", "fp32,bf16", "--out", str(tmp_path), *SMALL]  # fmt: skip
    assert bench(args) == 0
    out = capsys.readouterr().out
    assert f"{engine} {engines_version(engine)}'s selective_state_update (wheel " in out
    forms = engines.FORMS[engine]
    saved = json.loads((tmp_path / "bench-engine.json").read_text())
    assert [(c["form"], c["state_dtype"], c["batch"]) for c in saved["cells"]] == [
        (form, state, batch) for form in forms for state in ("fp32", "bf16") for batch in (1, 3)
    ]
    for cell in saved["cells"]:
        assert set(cell["times"]) == {engine, "reference"}
        output, states = cell["differences"]["reference"]
        budgets = engines.budgets(cell["state_dtype"], "bf16", cell["tokens"])
        assert output <= budgets[0] and states <= budgets[1], cell
        assert max(output, states) > 0 or cell["state_dtype"] == "fp32", cell  # compared, not skipped
    assert "MISMATCH" not in out and f"reference/{engine}" in out


def engines_version(engine: str) -> str:
    return engine_kernels.ENGINES[engine]["version"]


def test_a_backend_that_computes_something_else_is_reported_not_timed(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    right = engines.drop_in

    def forgets_D(backend):
        serve = right(backend)
        return lambda state, x, dt, A, B, C, **kw: serve(state, x, dt, A, B, C, **dict(kw, D=None))

    monkeypatch.setattr(engines, "drop_in", forgets_D)
    args = ["bench", "--engine", "vllm", "--engine-wheel", _wheel("vllm"), "--device", "cpu", "--backends",
            "reference", *SMALL[:-2], "--batches", "2"]  # fmt: skip
    assert bench(args) == 1
    out = capsys.readouterr().out
    assert "MISMATCH (not timed): reference decode state fp32 batch 2: outputs" in out
    assert "MISMATCH (not timed): reference speculative state fp32 batch 2" in out


def test_an_engine_that_is_not_here_is_named_with_its_remedy(capsys, tmp_path):
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert main(["bench", "--engine", "vllm", "--device", "cpu"]) == 2
        assert "pip install vllm==0.34.0, or pass --engine-wheel" in capsys.readouterr().err
    assert main(["bench", "--engine", "vllm", "--engine-wheel", str(tmp_path / "nothing"), "--device", "cpu"]) == 2
    assert "nothing: no such wheel or folder" in capsys.readouterr().err
    assert main(["bench", "--engine-wheel", str(tmp_path), "--device", "cpu"]) == 2
    assert "--engine-wheel goes with --engine" in capsys.readouterr().err


def test_the_engines_files_come_out_of_the_wheel_into_a_folder(tmp_path):
    """What scripts/engine-kernels writes: the kernel and, for vLLM, its helpers, null block id and
    tuned launch configs (the H100's and H200's among them), loadable from the folder."""
    written = engine_kernels.extract("vllm", _wheel("vllm"), str(tmp_path))
    names = {p.split("/")[-1] for p in written}
    assert {"mamba_ssm.py", "triton_helpers.py", "utils.py"} <= names
    assert any("NVIDIA_H100_80GB_HBM3" in n for n in names) and any("NVIDIA_H200" in n for n in names)
    loaded = engine_kernels.load("vllm", str(tmp_path), device_name=lambda: "cpu_interpreter")
    assert loaded.version == "0.34.0" and loaded.loaded.startswith("folder ")


def test_the_check_of_a_large_call_reads_it_a_few_rows_at_a_time():
    """The relative difference taken a few rows at a time (no float64 copy of a whole cache, which
    a batch of 512 over four tokens makes several GB) is the one taken at once, a non-finite value
    included."""
    import math

    import torch

    from ssu.checking.oracle import rel_error

    gen = torch.Generator().manual_seed(3)
    expected = torch.randn(70, 3, 5, generator=gen)
    actual = expected + 1e-3 * torch.randn(70, 3, 5, generator=gen)
    assert engines._rel_error_by_rows(actual, expected, rel_error, rows=8) == pytest.approx(
        rel_error(actual, expected), rel=1e-12
    )
    actual[64, 1, 2] = float("nan")
    assert engines._rel_error_by_rows(actual, expected, rel_error, rows=8) == math.inf
