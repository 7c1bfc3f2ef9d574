"""The command line's promise, checked in a subprocess as a user meets it: exit code 0 ok, 1 results
wrong, 2 usage or config error, 3 internal error; an error is one line on stderr, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SMALL = ["--nheads", "4", "--headdim", "8", "--dstate", "16", "--ngroups", "2"]


def ssu(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    environment = dict(os.environ, **(env or {}))
    environment.pop("TRITON_INTERPRET", None)
    environment.pop("SSU_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "ssu", *args], capture_output=True, text=True, cwd=cwd, env=environment, timeout=300
    )


def one_error_line(result, code: int = 2) -> str:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "--pad-rows", "-1"], r"--pad-rows must be 0 to 3 \(at least one real row of --batch 4\), got -1"),
        (["run", "--pad-rows", "4", "--batch", "4"], r"--pad-rows must be 0 to 3 .* got 4"),
        (["run", "--slots", "2"], r"--batch 4 with --pad-rows 0 needs 4 distinct slots; --slots 2 has 2"),
        (
            ["run", "--batch", "10", "--slots", "4"],
            r"needs 10 distinct slots; --slots 4 has 4: give --slots 10 or more",
        ),
        (["run", "--slots", "0"], r"--slots must be at least 1, got 0"),
        (["run", "--layers", "0"], r"--layers must be at least 1, got 0"),
        (["run", "--steps", "-1"], r"--steps must be at least 1, got -1"),
        (["run", "--check-every", "-2"], r"--check-every must be 0 \(never\) or more"),
        (
            ["run", "--nheads", "1000000"],
            r"this run needs about [\d.]+ GiB but cpu has [\d.]+ GiB available: "
            r"its state, 4 layers x .* 30.5 GiB a slot",
        ),
        (
            ["run", "--layers", "100000"],
            r"needs about [\d.]+ GiB but cpu has [\d.]+ GiB available: its state, 100000 layers x 9 rows "
            r"\(8 slots and the sink row\) x 4.0 MiB a slot, is .*; use fewer --layers, --slots or --batch, or",
        ),
        (
            ["explain", "--batch", "8", "--slots", "2"],
            r"^ssu explain: error: --batch 8 needs 8 distinct slots; --slots 2 has 2: give --slots 8 or more$",
        ),
        (
            ["explain", "--nheads", "100000000"],
            r"one layer's state for this problem needs about [\d.]+ GiB \(9 rows \(8 slots and the sink row\) x "
            r"3051.8 GiB a slot\) but cpu has [\d.]+ GiB in all; use fewer --slots, or smaller head shapes$",
        ),
        (
            ["explain", "--tokens", "100000"],
            r"needs about 3515.7 GiB \(9 rows .* x 100001 versions \(T \+ 1 for --tokens 100000\) x 4.0 MiB a slot\)"
            r" but cpu has [\d.]+ GiB in all; use fewer --slots or --tokens, or smaller head shapes$",
        ),
        (["run", "--backend", "tritn"], r"unknown backend 'tritn' \(did you mean 'triton'\?\)"),
        (["run", "--state-dtype", "int4"], r"--state-dtype: 'int4' is not a dtype ssu knows"),
        (
            ["explain", "--input-dtype", "fp8"],
            r"--input-dtype: fp8 \(fp8_e4m3\) is not an input dtype; use one of bf16, ",
        ),
        (
            ["verify", "--state-dtype", "fp32,fp9"],
            r"--state-dtype: 'fp9' is not a dtype ssu knows; use one of fp32, bf16",
        ),
        (
            ["compare", "--state-dtype", "bf16"],
            r"--state-dtype: bf16 is not an 8-bit state dtype; use one of int8, fp8_e4m3$",
        ),
        (
            ["compare", "--dtype", "half"],
            r"--dtype: half \(fp16\) is not a dtype ssu compare loads models in; use one of fp32, bf16$",
        ),
        (
            ["bench", "--state-dtype", "fp9"],
            r"--state-dtype: 'fp9' is not a dtype ssu knows; use one of fp32, bf16, fp16, int8, fp8_e4m3$",
        ),
        (
            ["bench", "--batches", "-1,a"],
            r"--batches -1,a: '-1' is not a batch size; give positive whole numbers, comma-separated",
        ),
        (
            ["bench", "--from", "nothing.json", "--batches", "1"],
            r"--from renders a saved run as it was measured: leave out --batches",
        ),
        (["explain", "--batch", "0"], r"--batch must be at least 1, got 0"),
        (["explain", "--nheads", "6", "--ngroups", "4"], r"--nheads 6 is not a multiple of --ngroups 4"),
        (["backends", "--device", "foo"], r"--device 'foo' is not a device"),
        (
            ["verify", "--backend", "triton"],
            r"backend 'triton' is unavailable on cpu: on the CPU Triton runs only in its "
            r"interpreter; set TRITON_INTERPRET=1",
        ),
        (["frobnicate"], r"invalid choice: 'frobnicate'"),
    ],
)
def test_usage_errors(args, message):
    import re

    line = one_error_line(ssu(*args))
    assert re.search(message, line), line


def test_runs_memory_refusal_adds_up():
    """Each factor of the state with its option, and parts that sum to the total."""
    import re

    line = one_error_line(ssu("run", "--tokens", "100000"))
    numbers = r"([\d.]+) (GiB|MiB)"
    match = re.search(
        rf"needs about {numbers} but cpu has [\d.]+ GiB available: its state, 4 layers x 9 rows \(8 slots and "
        rf"the sink row\) x 100001 versions \(T \+ 1 for --tokens 100000\) x 4.0 MiB a slot, is {numbers}, the "
        rf"checks' oracle copies {numbers}, its starting states and untouched-slot copies {numbers}; use fewer "
        r"--layers, --slots, --batch or --tokens, or smaller head shapes$",
        line,
    )
    assert match, line
    total, state, checks, copies = (
        float(v) * (1 if unit == "GiB" else 2**-10) for v, unit in zip(*[iter(match.groups())] * 2)
    )
    assert state == pytest.approx(4 * 9 * 100001 * 4 / 1024, abs=0.05)
    assert total == pytest.approx(state + checks + copies, abs=0.1)


def test_explain_refusing_the_backend_says_so_on_stderr_as_run_does():
    """The report on stdout, the refusal ``ssu run`` gives on stderr, exit 2."""
    explained = ssu("explain", "--backend", "flashinfer", *SMALL)
    line = one_error_line(explained)
    assert "flashinfer: rejected: backend 'flashinfer' is installed but unavailable on cpu" in explained.stdout
    assert line == one_error_line(ssu("run", "--backend", "flashinfer", *SMALL)).replace("ssu run:", "ssu explain:")


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda tmp: tmp / "nonexistent", "no such folder"),
        (lambda tmp: (tmp / "model.safetensors").write_text("x") and tmp / "model.safetensors", "not a folder"),
        (lambda tmp: tmp, "the folder has no config.json, so it holds no transformers checkpoint"),
    ],
    ids=["missing", "file", "no-config"],
)
def test_compare_names_a_checkpoint_folder_that_holds_none(tmp_path, make, reason):
    pytest.importorskip("transformers")
    where = make(tmp_path)
    line = one_error_line(ssu("compare", "--checkpoint", str(where)))
    assert line == (
        f"ssu compare: error: --checkpoint {where}: {reason}; give a local checkpoint folder (config.json and "
        "weights), or --hub NAME for a model on the Hugging Face hub"
    )
    from ssu.integrations.hf_models import pretrained_model  # the library says it too, without the option

    with pytest.raises(__import__("ssu").ConfigError, match=f"^checkpoint '{where}': {reason}; give a checkpoint"):
        pretrained_model(str(where), hub=False)


def test_an_exception_ssu_did_not_expect_is_an_internal_error_with_what_to_report(tmp_path):
    """Exit 3, not 1 (results wrong): one line naming the exception, where it was raised and what
    to report where; the traceback only with SSU_DEBUG=1."""
    package = tmp_path / "crashing"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "kernel.py").write_text("def step(args):\n    return {}['layout']\n")
    crash = (
        "import sys, crashing.kernel, ssu.cli.main as m; m.cmd_backends = crashing.kernel.step; "
        "sys.exit(m.main(['backends']))"
    )
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    environment.pop("SSU_DEBUG", None)
    run = dict(capture_output=True, text=True, timeout=300)
    line = one_error_line(subprocess.run([sys.executable, "-c", crash], env=environment, **run), code=3)
    assert line == (
        "ssu backends: internal error (a bug in ssu or a backend, not in what you gave): KeyError: 'layout' at "
        "crashing/kernel.py:2; report it to https://github.com/ssu-project/ssu/issues with the command line and "
        "the traceback that SSU_DEBUG=1 prints"
    )
    debug = subprocess.run([sys.executable, "-c", crash], env=dict(environment, SSU_DEBUG="1"), **run)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "KeyError: 'layout'" in debug.stderr


def test_new_backend_into_an_unwritable_folder(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = one_error_line(ssu("new-backend", "foo", "--dir", str(blocker / "sub")))
    assert "cannot write" in line and "pick a writable --dir" in line


def test_a_closed_pipe_is_not_an_error():
    result = subprocess.run(
        f"{sys.executable} -m ssu backends --json | head -1", shell=True, capture_output=True, text=True, timeout=300
    )
    assert result.stdout.strip() == "{" and result.stderr == ""


def test_run_reports_rates_and_says_when_nothing_was_checked():
    result = ssu("run", "--layers", "2", "--steps", "2", "--batch", "2", *SMALL)
    assert result.returncode == 0, result.stderr
    assert "step rate" in result.stdout and "kernel calls only" in result.stdout and "wall time" in result.stdout
    assert "result          OK" in result.stdout
    unchecked = ssu("run", "--layers", "2", "--steps", "2", "--batch", "2", "--check-every", "0", *SMALL)
    assert unchecked.returncode == 0, unchecked.stderr
    assert "result          OK" not in unchecked.stdout and "not checked" in unchecked.stdout


def test_check_config_resolves_backend_names(tmp_path):
    (tmp_path / "typo.toml").write_text('[ssu]\nbackend = "flashinfr"\n')
    assert "did you mean 'flashinfer'" in one_error_line(ssu("check-config", "typo.toml", cwd=tmp_path))
    (tmp_path / "list.toml").write_text('[ssu]\nbackend = ["tritn", "reference"]\n')
    assert "did you mean 'triton'" in one_error_line(ssu("check-config", "list.toml", cwd=tmp_path))
    (tmp_path / "range.toml").write_text('[ssu]\nbackend = "triton"\n[ssu.backends.triton]\nphilox_rounds = 11\n')
    line = one_error_line(ssu("check-config", "range.toml", cwd=tmp_path))
    assert line.endswith("range.toml: ssu.backends.triton.philox_rounds=11 is out of range; use 1 to 10")


def test_check_config_without_a_file_checks_the_one_load_config_finds(tmp_path):
    result = ssu("check-config", cwd=tmp_path)
    assert result.returncode == 0 and "no config file in" in result.stdout
    (tmp_path / "ssu.toml").write_text('[ssu]\nbackend = "refernce"\n')
    assert "did you mean 'reference'" in one_error_line(ssu("check-config", cwd=tmp_path))
    (tmp_path / "ssu.toml").write_text('[ssu]\nbackend = "reference"\n')
    result = ssu("check-config", cwd=tmp_path)
    assert result.returncode == 0 and "ssu.toml: OK" in result.stdout


def test_verify_reports_skipped_checks_and_verifies_what_auto_selects():
    result = ssu("verify", "--backend", "auto", "--profile", "smoke")
    assert result.returncode == 0, result.stderr
    assert "backend reference (from auto) on cpu" in result.stdout
    assert "SKIP  cuda-graph" in result.stdout and "needs a CUDA device" in result.stdout
    assert "PASS  cuda-graph" not in result.stdout and "1 skipped" in result.stdout.splitlines()[-1]


def test_a_plugin_filter_naming_nothing_warns():
    result = ssu("backends", "--no-probe", env={"SSU_PLUGINS": "tritn"})
    assert result.returncode == 0
    warning = [line for line in result.stderr.splitlines() if line]
    assert warning == [warning[0]] and "SSU_PLUGINS names 'tritn', which is no installed backend" in warning[0]
    assert "did you mean 'triton'" in warning[0]


def test_version_and_explain_lists_every_backend():
    result = ssu("--version")
    assert result.returncode == 0 and result.stdout.startswith("ssu 0.1.0") and "plugin API" in result.stdout
    result = ssu("explain", *SMALL)
    assert result.returncode == 0
    for name in ("reference: selected", "triton: not requested", "flashinfer: not requested"):
        assert name in result.stdout


def test_check_config_fails_on_a_selected_backend_that_does_not_import(tmp_path, monkeypatch):
    """As `ssu run` would: the import error, naming the file; a broken backend the file only
    holds options for is a note."""
    from fakes import FakeSite

    site = FakeSite(tmp_path / "site", monkeypatch)
    site.add("ssu-backend-broken", {"broken": "broken_cli_mod"}, modules={"broken_cli_mod": "import no_such_mod_xyz\n"})
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    (tmp_path / "ssu.toml").write_text('[ssu]\nbackend = ["broken", "reference"]\n')
    line = one_error_line(ssu("check-config", cwd=tmp_path, env=env))
    assert "ssu.toml: backend:" in line and "no_such_mod_xyz" in line and "ssu-backend-broken" in line
    line = one_error_line(ssu("run", "--backend", "broken", *SMALL, cwd=tmp_path, env=env))
    assert "no_such_mod_xyz" in line
    (tmp_path / "ssu.toml").write_text('[ssu]\nbackend = "reference"\n[ssu.backends.broken]\nx = 1\n')
    result = ssu("check-config", cwd=tmp_path, env=env)
    assert result.returncode == 0 and "note: options for 'broken' not checked" in result.stdout
    assert "no_such_mod_xyz" in result.stdout


def test_an_unknown_backend_in_a_file_names_the_file(tmp_path):
    (tmp_path / "ssu.toml").write_text('[ssu]\nbackend = "trtion"\n')
    line = one_error_line(ssu("run", *SMALL, cwd=tmp_path))
    assert f"{tmp_path / 'ssu.toml'}: backend: unknown backend 'trtion' (did you mean 'triton'?)" in line
    line = one_error_line(ssu("run", *SMALL, cwd=tmp_path, env={"SSU_BACKEND": "refrence"}))
    assert line.startswith("ssu run: error: SSU_BACKEND: unknown backend 'refrence'")


@pytest.mark.parametrize(
    "name, text, args, key",
    [
        ("ssu.toml", "ssu = 3\n", ["check-config"], "ssu must be a table"),
        ("ssu.toml", "[[ssu]]\n", ["run", *SMALL], "ssu must be a table"),
        ("pyproject.toml", "tool = 3\n", ["explain"], "tool must be a table"),
        ("pyproject.toml", '[tool]\nssu = "x"\n', ["backends", "--no-probe", "--json"], None),
        ("pyproject.toml", '[tool]\nssu = "x"\n', ["verify"], "tool.ssu must be a table"),
    ],
    ids=["ssu=3", "[[ssu]]", "tool=3", "tool.ssu=x-unread", "tool.ssu=x"],
)
def test_a_config_whose_ssu_or_tool_is_no_table_names_the_key(tmp_path, name, text, args, key):
    """One line naming the file and the key, exit 2, for a command that reads the configuration;
    ``ssu backends`` reads none and runs."""
    (tmp_path / name).write_text(text)
    result = ssu(*args, cwd=tmp_path)
    if key is None:
        assert result.returncode == 0, result.stderr
        return
    line = one_error_line(result)
    assert line.startswith(f"ssu {args[0]}: error: {tmp_path / name}: {key} (a [")


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a CUDA device")
@pytest.mark.parametrize(
    "args",
    [
        ["run", "--device", "cuda"],
        ["compare", "--arch", "nemotron_h", "--preset", "nemotron-h-8b", "--layers", "4", "--device", "cuda"],
        ["bench", "--device", "cuda:1"],
    ],
    ids=["run", "compare", "bench"],
)
def test_a_cuda_device_on_a_machine_without_one_is_a_usage_error(args):
    line = one_error_line(ssu(*args))
    assert "no CUDA device" in line and ("--device cuda" in line or "this machine has no CUDA device" in line)


def test_library_messages_speak_the_command_line(capsys):
    """A backend's remedy names its argument (device='cuda'); the command line says the option."""
    from ssu.cli.main import main
    from ssu.cli.usage import spoken

    assert spoken("use device='cuda' or device=\"cpu\"") == "use --device cuda or --device cpu"
    main(["explain", "--backend", "reference"])
    out = capsys.readouterr().out
    assert "device='" not in out
    assert "--device cuda" in out or "FlashInfer" not in out


def test_a_config_with_several_errors_gives_one_line_per_error_each_naming_the_file(tmp_path):
    (tmp_path / "two.toml").write_text('[ssu]\nbackend = "reference"\nvalidat = true\nbackedn = "x"\n')
    result = ssu("check-config", "two.toml", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("ssu check-config: error: two.toml: ssu.validat: unknown option (did you mean 'valid")
    assert lines[1].startswith("ssu check-config: error: two.toml: ssu.backedn: unknown option (did you mean 'backe")
    (tmp_path / "ssu.toml").write_text(
        '[ssu]\nbackend = "triton"\n[ssu.backends.triton]\nnum_wrps = 3\nphilox_rounds = "x"\n'
    )
    lines = ssu("check-config", cwd=tmp_path).stderr.strip().splitlines()
    assert len(lines) == 2 and all(
        line.startswith(f"ssu check-config: error: {tmp_path / 'ssu.toml'}: ") for line in lines
    )
    assert "num_wrps: unknown option" in lines[0] and "philox_rounds: expected an integer" in lines[1]


def test_an_error_with_details_keeps_them_indented_under_it():
    from ssu.cli.main import error_lines

    message = "no backend of a, b can serve this problem:\n  - a: why\n  - b: why not"
    assert error_lines("ssu run: error: ", message).splitlines() == [
        "ssu run: error: no backend of a, b can serve this problem:",
        "    - a: why",
        "    - b: why not",
    ]
    assert error_lines("p: ", "one\ntwo") == "p: one\np: two" and error_lines("p: ", "") == "p: "
