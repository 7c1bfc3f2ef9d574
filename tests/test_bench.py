"""``ssu bench`` without a GPU: arguments, the table, JSON and plot, the recommendation (ties,
backends fastest in some ranges only), and the refusal to pretend a CPU is a benchmark."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ssu.bench import measure, report
from ssu.cli.main import main

SMALL = ["--nheads", "4", "--headdim", "8", "--dstate", "16", "--ngroups", "2"]


def row(backend, batch, us, state="fp32", tokens=1, adopt=False):
    return measure.Row(measure.Case(backend, 128, 64, 128, 8, state, "bf16", tokens, batch, adopt), us)


def test_a_machine_without_a_gpu_is_told_so():
    import os

    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run(
        [sys.executable, "-m", "ssu", "bench"], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "no CUDA device" in result.stderr and "--device cpu" in result.stderr


#: a measuring smoke run's options; ``{dir}`` in an argument is the test's folder of input files
CPU = ["--device", "cpu", *SMALL]
#: a saved run's one row, whole
SAVED_ROW = {"backend": "x", "nheads": 4, "headdim": 8, "dstate": 16, "ngroups": 2, "us": 1.0}
SAVED_RUN = {"title": "ssu bench", "ceiling_tbps": 3.0, "rows": [SAVED_ROW]}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--batches", "0,8"], "--batches 0,8: '0' is not a batch size; give positive whole numbers, comma-separated"),
        (["--batches", "x"], "--batches x: 'x' is not a batch size; give positive whole numbers"),
        (["--batches", "-1,a"], "--batches -1,a: '-1' is not a batch size; give positive whole numbers"),
        (["--batches", ","], "--batches ',' names no batch size; give positive whole numbers"),
        (["--nheads", "0"], "--nheads must be at least 1"),
        (["--iterations", "0"], "--iterations must be at least 1, got 0"),
        (["--tokens", "0"], "--tokens must be at least 1, got 0"),
        (["--device", "nope"], "--device 'nope' is not a device"),
        (
            ["--state-dtype", "int4"],
            "--state-dtype: 'int4' is not a dtype ssu knows; use one of fp32, bf16, fp16, int8, fp8_e4m3",
        ),
        (["--state-dtype", "fp32,fp9"], "--state-dtype: 'fp9' is not a dtype ssu knows; use one of fp32, bf16"),
        (["--state-dtype", "int32"], "--state-dtype: int32 is not a state cache dtype; use one of fp32, bf16"),
        (["--state-dtype", ","], "--state-dtype: ',' names no dtype; give one or more of fp32, bf16, fp16"),
        (["--input-dtype", "int8"], "--input-dtype: int8 is not an input dtype; use one of bf16, fp16, fp32"),
        (["--input-dtype", "bfloat17"], "--input-dtype: 'bfloat17' is not a dtype ssu knows; use one of bf16"),
        (["--backends", "nosuch"], "--backends: unknown backend 'nosuch'. Installed backends: "),
        (["--backends", "refrence"], "--backends: unknown backend 'refrence' (did you mean 'reference'?)"),
        (["--backends", ""], "--backends '' names no backend; give backend names, comma-separated, or all"),
        (["--backends", "flashinfer"], "--backends flashinfer: no backend to time here (flashinfer: backend"),
        (["--ceiling", "3"], "--ceiling goes with --from (it states a saved run's rows against another copy ceiling)"),
        (["--call", "verify", "--adopt"], "always timed on an adopted cache; leave --adopt out"),
        (["--engine", "vllm", "--tokens", "2"], "--engine times the engine's own calls (decode, and T = 4 specul"),
        (["--engine", "vllm", "--state-dtype", "int8"], "--state-dtype: int8 is not a state dtype the engines' ker"),
        (["--out", "{dir}/a-file"], "--out {dir}/a-file: a file, not a folder; give a folder (made if missing)"),
        (["--out", "{dir}/a-file/run"], "--out {dir}/a-file/run: {dir}/a-file is a file, so no folder can be made"),
    ],
)
def test_a_bad_option_is_one_line_before_anything_is_timed_or_written(args, message, tmp_path, monkeypatch, capsys):
    assert_refused_before_work(CPU + args, message, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ceiling", "0"], "--ceiling 0: give the copy ceiling in TB/s, a positive number such as 3.35"),
        (["--ceiling", "-1"], "--ceiling -1: give the copy ceiling in TB/s, a positive number"),
        (["--ceiling", "nan"], "--ceiling nan: give the copy ceiling in TB/s, a positive number"),
        (["--batches", "1,8"], "--from renders a saved run as it was measured: leave out --batches (they apply to"),
        (
            ["--state-dtype", "bf16", "--iterations", "5", "--device", "cpu", "--adopt"],
            "leave out --state-dtype, --adopt, --iterations, --device (they apply to a run that measures; with "
            "--from only --ceiling and --out do)",
        ),
        (["--out", "{dir}/a-file"], "--out {dir}/a-file: a file, not a folder"),
    ],
)
def test_an_option_a_saved_run_cannot_take_is_refused(args, message, tmp_path, monkeypatch, capsys):
    assert_refused_before_work(["--from", "{dir}/run.json", *args], message, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize(
    "content, message",
    [
        (
            None,
            "--from {dir}/run.json: cannot read it (No such file or directory); give the bench.json that ssu "
            "bench --out wrote",
        ),  # fmt: skip
        ('{"rows": [', "--from {dir}/run.json: not JSON (line 1, column 11); give the bench.json that ssu bench"),
        (b"\x80\x81 binary", "--from {dir}/run.json: not a JSON text file; give the bench.json"),
        ("[1, 2]", "--from {dir}/run.json: JSON, but not the rows of an ssu bench run; give the bench.json"),
        ('{"cells": []}', "--from {dir}/run.json: an ssu bench --engine run, which --from does not render"),
        ('{"rows": [{"backend": "x"}]}', "row 1 of the saved run has no nheads, headdim, dstate, ngroups, us"),
        ('{"rows": [3]}', "--from {dir}/run.json: row 1 of the saved run is not a table"),
        (
            json.dumps({"rows": [dict(SAVED_ROW, us="fast")]}),
            "row 1 of the saved run has no positive time in us ('fast')",
        ),
        (
            json.dumps({"rows": [dict(SAVED_ROW, state_dtype="fp9")]}),
            "row 1 of the saved run has state_dtype: 'fp9' is not a dtype ssu knows; use one of fp32",
        ),
        (
            json.dumps({"rows": [SAVED_ROW], "ceiling_tbps": "x"}),
            "--from {dir}/run.json: its ceiling_tbps 'x' is not a positive number",
        ),
    ],
    ids=["missing", "truncated", "binary", "a-list", "engine-run", "no-fields", "not-a-row", "time", "dtype", "ceil"],
)
def test_a_file_that_is_not_a_saved_run_is_said_in_ssus_words(content, message, tmp_path, monkeypatch, capsys):
    (tmp_path / "in").mkdir()
    if content is not None:
        path = tmp_path / "in" / "run.json"
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    line = assert_refused_before_work(["--from", "{dir}/run.json"], message, tmp_path, monkeypatch, capsys)
    assert "Expecting" not in line and "codec" not in line  # the JSON parser's own words stay out


def assert_refused_before_work(args, message, tmp_path, monkeypatch, capsys) -> str:
    """``ssu bench ARGS --out DIR`` exits 2 with ``message`` as its one line on stderr, having
    printed, timed and written nothing (``{dir}`` is a folder of inputs: a file ``a-file``, a saved
    run ``run.json`` unless the test wrote one)."""
    inputs = tmp_path / "in"
    inputs.mkdir(exist_ok=True)
    (inputs / "a-file").write_text("kept")
    if not (inputs / "run.json").exists() and "--from" in args and message.find("run.json:") < 0:
        (inputs / "run.json").write_text(json.dumps(SAVED_RUN))
    before = sorted(p.name for p in inputs.iterdir())
    timed = []
    monkeypatch.setattr(measure, "measure", lambda *a, **k: timed.append(a))
    monkeypatch.setattr(measure, "copy_ceiling_tbps", lambda *a, **k: timed.append(a))
    argv = [a.replace("{dir}", str(inputs)) for a in args]
    out = tmp_path / "out"
    extra = [] if "--out" in argv else ["--out", str(out)]
    assert main(["bench", *argv, *extra]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert message.replace("{dir}", str(inputs)) in lines[0]
    assert lines[0].startswith("ssu bench: error: ")
    assert not timed and not out.exists() and sorted(p.name for p in inputs.iterdir()) == before
    assert (inputs / "a-file").read_text() == "kept"
    return lines[0]


def test_every_spelling_of_a_dtype_problem_takes_is_timed_under_its_own_name(tmp_path, capsys):
    """``fp8``, torch's names and repeats: each state dtype once, the rows and files in ssu's names."""
    from ssu.cli.bench import cmd_bench
    from ssu.cli.main import _parser

    states = "fp8,float8_e4m3fn,bfloat16,torch.float32"
    args = ["bench", *CPU, "--backends", "reference", "--batches", "1", "--state-dtype", states, "--input-dtype",
            "float16", "--out", str(tmp_path)]  # fmt: skip
    assert cmd_bench(_parser().parse_args(args), timer=lambda launches, min_launches=1: 5.0) == 0
    assert "input fp16" in capsys.readouterr().out
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [(r["state_dtype"], r["input_dtype"]) for r in rows] == [
        ("fp8_e4m3", "fp16"),
        ("bf16", "fp16"),
        ("fp32", "fp16"),
    ]


def test_a_saved_run_is_rendered_again_against_another_ceiling(tmp_path, capsys):
    """``--from`` a run's bench.json, with ``--ceiling`` and ``--out``: the same rows, stated
    against the ceiling given, written to the new folder."""
    saved = tmp_path / "saved.json"
    rows = [row("triton", 8, 18.8), row("flashinfer", 8, 21.0)]
    report.write_json(saved, rows, {"title": "ssu bench then", "ceiling_tbps": 3.0}, {}, report.recommend(rows))
    assert main(["bench", "--from", str(saved), "--ceiling", "4.26", "--out", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ssu bench then (copy ceiling 4.26 TB/s)") and "triton" in out and "1.12x" in out
    assert json.loads((tmp_path / "again" / "bench.json").read_text())["ceiling_tbps"] == 4.26


def test_traffic_and_bandwidth():
    r = row("triton", 32, 68.4)
    assert r.case.slot_bytes == 128 * 64 * 128 * 4 and r.case.state_traffic == 2 * 32 * r.case.slot_bytes
    assert abs(r.tbps - r.case.state_traffic / 68.4e-6 / 1e12) < 1e-9
    assert row("triton", 8, 1.0, tokens=4).case.state_traffic == 5 * 8 * 128 * 64 * 128 * 4


def test_recommendation_merges_ranges_and_handles_ties():
    rows = [
        row("triton", 1, 4.7),
        row("replay", 1, 9.6),
        row("triton", 8, 18.8),
        row("replay", 8, 22.9),
        row("triton", 32, 68.4),
        row("replay", 32, 54.1),
        row("triton", 128, 264.7),
        row("replay", 128, 162.7),
        row("triton", 256, 310.0),
        row("replay", 256, 314.0),
    ]  # a tie at 256 keeps the winner before it
    spans = report.recommend(rows)
    assert [(s.low, s.high, s.backend) for s in spans] == [(1, 8, "triton"), (32, 256, "replay")]
    assert spans[1].tied == ("triton",)
    text = report.advice(spans, rows)
    assert "batches 1 to 8: triton" in text and "batches 32 to 256: replay (within 3%: triton)" in text
    assert "no one backend is fastest at every batch" in text
    assert 'backend = ["replay", "triton", "reference"]' in text
    only = report.recommend([row("a", 1, 2.0), row("b", 1, 2.01)])
    assert [(s.backend, s.tied) for s in only] == [("a", ("b",))]
    assert report.advice([], []).startswith("nothing measured")


def test_table_json_and_plot(tmp_path):
    rows = [row("triton", 8, 18.8), row("flashinfer", 8, 21.0), row("triton", 32, 68.4), row("flashinfer", 32, 74.4)]
    text = report.table(rows, 4.26, {"replay": "unavailable here"})
    lines = text.splitlines()
    assert "fastest" in lines[1] and lines[2].endswith("1.12x") and "of copy" in lines[0]
    assert "replay" in lines[-1] and "not measured: unavailable here" in lines[-1]
    spans = report.recommend(rows)
    report.write_json(tmp_path / "b.json", rows, {"title": "t"}, {"replay": "why"}, spans)
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["rows"][0]["backend"] == "triton" and data["refused"] == {"replay": "why"}
    assert data["recommendation"][0]["backend"] == "triton"
    pytest.importorskip("matplotlib")
    assert report.plot(tmp_path / "b.png", rows, "title", 4.26)
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_table_says_what_each_state_dtype_buys_against_bf16():
    rows = [row("triton", b, us, "bf16") for b, us in ((128, 138.5), (512, 535.8))]
    rows += [row("triton", b, us, "int8") for b, us in ((128, 95.2), (512, 361.4), (1024, 719.2))]
    rows += [row("triton", 128, 70.0, "bf16", adopt=True), row("flashinfer", 128, 100.0, "int8")]
    lines = report.table(rows, 4.26, {}).splitlines()
    assert "triton: state int8 against bf16, T=1, speedup by batch: 128 1.45x, 512 1.48x" in lines
    assert not [line for line in lines if "flashinfer: state" in line or "adopted cache): state" in line]
    assert report.state_speedups([row("triton", 8, 1.0)]) == []


def test_a_cpu_smoke_run_over_two_backends_writes_all_outputs(tmp_path, capsys):
    """reference and triton (in its interpreter) with a fake timer: the whole command's output."""
    from ssu.cli.bench import cmd_bench
    from ssu.cli.main import _parser

    pytest.importorskip("matplotlib")
    fake = {"n": 0}

    def timer(launches, min_launches=1):
        fake["n"] += 1
        return 10.0 * fake["n"]

    args = _parser().parse_args(
        [
            "bench",
            "--device",
            "cpu",
            "--backends",
            "reference,triton,flashinfer",
            "--batches",
            "1,2",
            "--state-dtype",
            "fp32,bf16",
            "--adopt",
            "--out",
            str(tmp_path),
            *SMALL,
        ]
    )
    assert cmd_bench(args, timer=timer) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "[1/" in captured.err and "warming up and timing" in captured.err  # progress per case
    assert "a CPU smoke run (wall-clock times of reference, triton (triton in Triton's interpreter)" in out
    assert "triton+adopted" in out and "flashinfer" in out
    assert "recommends no backend" in out and "ssu.toml:" not in out
    measured = [line.split() for line in out.splitlines() if line.split()[:1] in (["reference"], ["triton+adopted"])]
    assert measured and all(cells[5] == "-" and cells[-1] == "-" for cells in measured)  # no bandwidth, no ranking
    assert {p.name for p in tmp_path.iterdir()} == {"bench.txt", "bench.json", "bench.png"}
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["rows"]) == 2 * 2 * 2 * 2 and "flashinfer" in data["refused"]


def test_engine_call_forms_are_timed_on_an_adopted_cache(tmp_path, capsys):
    """``--call packed`` / ``--call verify``: the engines' call forms (a smoke run on the CPU), their
    traffic floor a read per sequence and a write per token, backends without the form not measured."""
    out = tmp_path / "run"
    args = ["bench", "--device", "cpu", "--tokens", "4", "--batches", "4", *SMALL, "--out", str(out)]
    assert main([*args, "--call", "packed", "--backends", "reference,triton-replay"]) == 0
    text = capsys.readouterr().out
    assert "vLLM's packed call" in text and "engine call 'packed'" in text
    (saved,) = json.loads((out / "bench.json").read_text())["rows"]
    assert saved["call"] == "packed" and saved["batch"] == 4
    lengths = measure.packed_lengths(4, 4)
    assert lengths == [4, 4, 4, 1] and measure.packed_lengths(8, 4)[7] == 2
    slot = 4 * 8 * 16 * 4
    assert saved["traffic"]["state read"] == 4 * slot and saved["traffic"]["state write"] == sum(lengths) * slot
    assert main([*args, "--call", "verify", "--backends", "reference"]) == 0
    assert "SGLang's verify call" in capsys.readouterr().out
    assert main([*args, "--call", "verify", "--adopt"]) == 2
    assert "always timed on an adopted cache" in capsys.readouterr().err


def test_a_plain_cpu_smoke_run_takes_seconds_on_small_shapes(capsys):
    """Without shapes or batches a CPU smoke run times small shapes at batches 1 and 2 and says so;
    the shapes of a model given explicitly are kept."""
    assert main(["bench", "--device", "cpu", "--backends", "reference"]) == 0
    out = capsys.readouterr().out
    assert "H=4 P=8 N=16 G=2" in out and "a CPU smoke run (wall-clock times of reference; not a benchmark)" in out
    rows = [line for line in out.splitlines() if line.startswith("reference ")]
    assert [line.split()[3] for line in rows] == ["1", "2"] and all(line.split()[5] == "-" for line in rows)
    assert (
        main(["bench", "--device", "cpu", "--backends", "reference", "--model", "mamba2-2.7b", "--batches", "1"]) == 0
    )
    assert "H=80 P=64 N=128 G=1" in capsys.readouterr().out


def test_the_table_header_names_are_apart_and_aligned_with_the_rows():
    import re

    rows = [
        row("flashinfer-replayssm+adopted", 1024, 1299.7, "fp8_e4m3", tokens=16),
        row("triton", 1024, 1279.0, "fp8_e4m3", tokens=16),
        row("t", 1, 3.25),
    ]
    rows[0] = measure.Row(rows[0].case, rows[0].us, traffic=(("state", 4.26e9),))
    for ceiling, smoke in ((4.26, False), (None, True)):
        lines = report.table(rows, ceiling, {"replay": "unavailable here"}, smoke=smoke).splitlines()
        header, body = lines[0], lines[1 : 1 + len(rows)]
        assert re.split(r" {2,}", header) == list(report.COLUMNS)  # names apart by two spaces at least
        names = [m.span() for m in re.finditer(r"\S+(?: \S+)*", header)]
        for line in body:
            cells = [m.span() for m in re.finditer(r"\S+", line)]
            assert len(cells) == len(names), line
            for i, ((start, end), (cell_start, cell_end)) in enumerate(zip(names, cells)):
                # the names' columns align left, the numbers' right, each under its name
                assert (cell_start == start) if i < report.NAMED else (cell_end == end), (header, line)
        assert lines[-1].startswith("replay" + " " * (len("flashinfer-replayssm+adopted") - len("replay") + 2))
