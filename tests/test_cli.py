"""The ``ssu`` command line: outputs, exit codes (0 ok, 1 wrong, 2 usage/config, 3 internal), no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ssu.cli.main import main

SMALL = ["--nheads", "4", "--headdim", "8", "--dstate", "16", "--ngroups", "2", "--batch", "2"]


def test_backends_json(capsys):
    assert main(["backends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    ref = next(b for b in data["backends"] if b["name"] == "reference")
    assert ref["status"] == "available" and ref["distribution"] == "ssu-core"
    assert ref["capabilities"]["speculative"] is True


def test_backends_text(capsys):
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "reference" in out and "available" in out


def test_explain(capsys):
    assert main(["explain", *SMALL]) == 0
    assert "-> reference: selected" in capsys.readouterr().out
    assert main(["explain", "--backend", "flashinfer,reference", *SMALL]) == 0
    out = capsys.readouterr().out
    assert " x flashinfer: rejected: " in out and "-> reference: selected" in out
    assert main(["explain", "--backend", "flashinfer", *SMALL]) == 2


def test_check_config(tmp_path, capsys):
    good = tmp_path / "ssu.toml"
    good.write_text('[ssu]\nbackend = ["reference"]\nvalidate = false\n')
    assert main(["check-config", str(good)]) == 0
    assert capsys.readouterr().out == f'{good}: OK (backend = "reference", validate = false)\n'  # TOML's spelling
    good.write_text('[ssu]\nbackend = ["reference", "auto"]\n')
    assert main(["check-config", str(good)]) == 2  # auto stands alone
    good.write_text('[ssu]\nvalidate = "full"\n')
    assert main(["check-config", str(good)]) == 0
    assert 'OK (backend = "reference", validate = "full")' in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('[ssu]\nbackend = "reference"\n[ssu.backends.refrence]\nx = 1\n')
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'reference'" in err and "Traceback" not in err
    assert main(["check-config", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err  # the remedy says what omitting the path reads, as find_config_file does
    assert f"config file not found: {tmp_path / 'missing.toml'} (give an existing file, or none: then ssu.toml" in err
    assert f"else a pyproject.toml with [tool.ssu], in the working directory {os.getcwd()} is read" in err


def test_run_small(capsys):
    assert main(["run", "--layers", "2", "--steps", "3", *SMALL]) == 0
    out = capsys.readouterr().out
    for word in ("backend         reference", "steps/s", "per layer-step", "GB/s", "max error", "result          OK"):
        assert word in out


def test_run_speculative_with_pad_rows(capsys):
    assert (
        main(
            [
                "run",
                "--layers",
                "2",
                "--steps",
                "3",
                "--tokens",
                "3",
                "--pad-rows",
                "1",
                "--state-dtype",
                "bf16",
                *SMALL,
            ]
        )
        == 0
    )
    assert "result          OK" in capsys.readouterr().out


def test_run_config_errors_exit_2(capsys):
    assert main(["run", "--backend", "tritn", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'triton'" in err and "Traceback" not in err
    assert main(["run", "--state-dtype", "int4", *SMALL]) == 2
    assert "not a dtype" in capsys.readouterr().err


def test_verify_selected_checks(capsys):
    assert main(["verify", "--backend", "reference", "--check", "roundtrip", "--check", "step", "--examples", "2"]) == 0
    out = capsys.readouterr().out
    assert (
        "2 passed, 0 failed, 0 skipped" in out
        and "ran 17 cases (0 at real shapes, 15 corners)" in out
        and "FAIL" not in out
    )


def test_verify_takes_the_quick_profile_on_the_cpu_and_says_why(capsys):
    from ssu.conformance.runner import device_profile

    assert main(["verify", "--backend", "reference", "--device", "cpu", "--check", "roundtrip"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("ssu verify: backend reference on cpu, profile quick (6 drawn problems per check")
    assert first.endswith(
        "chosen for the CPU: small drawn shapes, a run of seconds; for more: --profile default, --profile thorough"
    )
    assert device_profile("cuda:1") == ("default", "chosen for cuda")


@pytest.mark.parametrize("profile", ["smoke", "default"])
def test_verify_runs_the_profile_asked_for(profile, capsys):
    assert (
        main(["verify", "--backend", "reference", "--device", "cpu", "--profile", profile, "--check", "roundtrip"]) == 0
    )
    first = capsys.readouterr().out.splitlines()[0]
    assert f"profile {profile} (" in first and "chosen for" not in first and "--profile" not in first


def test_verify_names_each_check_as_it_starts(capsys, monkeypatch):
    """Each check's name is on stdout before the check runs, its result line after."""
    from ssu.conformance import runner

    printed_before = []
    original = runner.run_check

    def recording(backend, check, **kwargs):
        printed_before.append((check, capsys.readouterr().out))
        return original(backend, check, **kwargs)

    monkeypatch.setattr(runner, "run_check", recording)
    assert (
        main(["verify", "--backend", "reference", "--device", "cpu", "--check", "roundtrip", "--check", "warmup"]) == 0
    )
    rest = capsys.readouterr().out
    (first, before_first), (second, before_second) = printed_before
    assert (first, second) == ("roundtrip", "warmup")
    assert before_first.splitlines()[-1] == "  RUN   roundtrip       write_state/read_state round trip"
    assert "PASS  roundtrip" in before_second and before_second.splitlines()[-1].startswith("  RUN   warmup ")
    assert "PASS  warmup" in rest


def test_verify_usage_errors(capsys):
    assert main(["verify", "--backend", "reference", "--check", "stepp"]) == 2
    assert "no such check; the checks are step, decode" in capsys.readouterr().err
    assert main(["verify", "--backend", "reference", "--examples", "0"]) == 2
    assert "give a positive number" in capsys.readouterr().err


def test_usage_error_exit_2():
    result = subprocess.run([sys.executable, "-m", "ssu.cli.main", "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_every_option_of_every_command_has_help():
    import argparse

    from ssu.cli.main import _parser

    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = [
        f"ssu {name} {action.option_strings[0]}"
        for name, sub in commands.items()
        for action in sub._actions
        if action.option_strings and not isinstance(action, argparse._HelpAction) and not action.help
    ]
    assert not missing, missing


def test_compare_says_below_noise_instead_of_a_negative_or_noisy_ssu_time():
    """``ssu compare``'s SSU ms/token and share: the difference from the zeros' run where it
    exceeds the step times' spread, never a negative time or share."""
    from ssu.cli.compare import NOISE, ssu_share, step_spread

    zeros = [0.010, 0.0101, 0.0099, 0.010, 0.0100]
    assert step_spread(zeros) == pytest.approx(0.0000, abs=1e-4) and step_spread([0.01]) == 0.0
    assert ssu_share([0.012, 0.0121, 0.0119, 0.012, 0.012], zeros) == ("2.000", "17 %")
    assert ssu_share([0.0085, 0.0086, 0.0084, 0.0085, 0.0085], zeros) == (NOISE, NOISE)  # faster than zeros
    assert ssu_share([0.0102, 0.008, 0.013, 0.0101, 0.0121], zeros) == (NOISE, NOISE)  # within its own spread
    spread = [0.010 + 0.001 * (i % 5) for i in range(20)]  # a noisy zeros run hides a small difference
    assert ssu_share([s + 0.0005 for s in spread], spread) == (NOISE, NOISE)
    assert ssu_share([s + 0.003 for s in spread], spread)[0] == "3.000"


def test_check_config_prints_settings_as_toml(tmp_path, monkeypatch, capsys):
    from ssu.cli.main import toml_value

    assert [toml_value(v) for v in (True, False, "full", ("triton", "reference"))] == [
        "true",
        "false",
        '"full"',
        '["triton", "reference"]',
    ]
    monkeypatch.chdir(tmp_path)
    assert main(["check-config"]) == 0
    assert 'the defaults apply (backend = "reference", validate = true)' in capsys.readouterr().out


@pytest.mark.parametrize("option", ["--state-dtype", "--input-dtype"])
def test_every_dtype_an_unknown_dtype_error_suggests_is_accepted(option, capsys):
    assert main(["explain", option, "int4", *SMALL]) == 2
    err = capsys.readouterr().err
    assert "'int4' is not a dtype ssu knows; use one of " in err
    suggested = err.strip().rsplit("use one of ", 1)[1].split(", ")
    assert len(suggested) >= 3
    for name in suggested:
        assert main(["explain", option, name, *SMALL]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["verify", "--backend", "reference", "--state-dtype", "int4"]) == 2
    assert capsys.readouterr().err.strip().endswith("use one of fp32, bf16, fp16, int8, fp8_e4m3")


@pytest.mark.parametrize(
    "command",
    [
        ["explain", *SMALL],
        ["run", "--layers", "1", "--steps", "1", *SMALL],
        ["verify", "--backend", "reference", "--examples", "0"],  # stops at --examples, after the dtypes
        ["compare", "--arch", "nemotron_h", "--layers", "0"],  # stops at --layers, after the dtypes
    ],
    ids=["explain", "run", "verify", "compare"],
)
def test_every_dtype_option_takes_every_spelling_problem_takes(command, capsys):
    """``fp8``, torch's names (``float8_e4m3fn``, ``bfloat16``, ``torch.float32``) and ssu's own
    are one parser's: what Problem takes, every command's dtype option takes."""
    import ssu

    problem = ssu.Problem(nheads=4, headdim=8, dstate=16, state_dtype="fp8", input_dtype="bfloat16")
    assert (problem.state_dtype, problem.input_dtype) == ("fp8_e4m3", "bf16")
    options = {
        "explain": ["--state-dtype", "float8_e4m3fn", "--input-dtype", "bfloat16"],
        "run": ["--state-dtype", "fp8", "--input-dtype", "torch.float32"],
        "verify": ["--state-dtype", "fp8,int8,float32"],
        "compare": ["--dtype", "bfloat16", "--state-dtype", "fp8"],
    }[command[0]]
    code = main([*command, *options])
    captured = capsys.readouterr()
    if command[0] in ("explain", "run"):
        assert code == 0, captured.err
        assert "state=fp8_e4m3" in captured.out or "state fp8_e4m3" in captured.out, captured.out
    else:
        assert code == 2 and "dtype" not in captured.err, captured.err  # refused on a later option


def test_one_of_a_thing_is_singular(capsys):
    args = ["run", "--layers", "1", "--steps", "1", "--pad-rows", "1", *SMALL]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "run             1 layer x 1 step, batch 2 (1 pad row)" in out and "; 1 layer-step checked" in out
    assert main(["run", "--layers", "2", "--steps", "3", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "run             2 layers x 3 steps, batch 2" in out and "; 6 layer-steps checked" in out


def test_the_readme_command_table_names_every_option_and_only_real_ones():
    """Each option a row of README.md's command table names is one its command takes, and every
    option and argument a command takes is named in one of its rows (``[problem options]``
    stands for the options listed after the table, which must be add_problem_args' own)."""
    import argparse
    import re
    from pathlib import Path

    from ssu.cli.main import _parser
    from ssu.cli.problem_args import add_problem_args

    def options(parser) -> set:
        return {
            action.option_strings[-1]
            for action in parser._actions
            if action.option_strings and not isinstance(action, argparse._HelpAction)
        }

    text = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    section = text.split("\n## Command line\n", 1)[1].split("\n## ", 1)[0]
    listed = section.split("Problem options (of `explain` and `run`):", 1)[1].split("\n\n", 1)[0]
    problem = set(re.findall(r"`(--[a-z][a-z0-9-]*)`", listed))
    probe = argparse.ArgumentParser()
    add_problem_args(probe)
    assert problem == options(probe)

    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    named: dict = {}
    for usage in re.findall(r"^\| `(ssu [^`]*)` \|", section, re.M):
        usage = usage.replace("\\|", "|")
        word = usage.split()[1]
        real = options(parser) if word.startswith("--") else options(commands[word])
        given = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", usage))
        if "[problem options]" in usage:
            given |= problem
        assert given <= real, f"README's `{usage}`: {sorted(given - real)} are no options of it"
        named.setdefault(word, []).append((usage, given))
    for name, sub in commands.items():
        assert name in named, f"README's command table has no row for ssu {name}"
        given = set().union(*(g for _, g in named[name]))
        assert options(sub) <= given, f"README's rows of ssu {name} leave out {sorted(options(sub) - given)}"
        for action in sub._actions:
            if not action.option_strings:  # a positional argument: its name in capitals
                assert any(re.search(rf"\b{action.dest.upper()}\b", usage) for usage, _ in named[name]), action.dest
    assert named["--version"] and options(parser) == {"--version"}
