"""Config files: tables, precedence, and a clear ConfigError for every kind of bad input."""

from __future__ import annotations

import pytest

import ssu
from ssu.plugins.config import find_config_file


def write(tmp_path, text, name="ssu.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults():
    config = ssu.load_config(search=False, env={})
    assert config.backend == "reference" and config.validate is True and config.backends == {}
    assert ssu.Config() == config


def test_ssu_toml(tmp_path):
    path = write(
        tmp_path, '[ssu]\nbackend = ["triton", "reference"]\nvalidate = "full"\n[ssu.backends.triton]\nnum_warps = 8\n'
    )
    config = ssu.load_config(path, env={})
    assert config.backend == ("triton", "reference")
    assert config.candidates == ("triton", "reference")
    assert config.validate == "full"
    assert config.options_for("triton") == {"num_warps": 8}
    assert "file" in config.source


def test_pyproject_tool_table(tmp_path):
    path = write(tmp_path, '[project]\nname = "x"\n[tool.ssu]\nbackend = "auto"\n', "pyproject.toml")
    assert ssu.load_config(path, env={}).backend == "auto"
    assert find_config_file(tmp_path) == path


def test_search_prefers_ssu_toml(tmp_path, monkeypatch):
    write(tmp_path, '[tool.ssu]\nbackend = "auto"\n', "pyproject.toml")
    write(tmp_path, '[ssu]\nbackend = "reference"\n')
    monkeypatch.chdir(tmp_path)
    assert ssu.load_config(env={}).backend == "reference"


def test_precedence(tmp_path):
    path = write(tmp_path, '[ssu]\nbackend = "triton"\n')
    assert ssu.load_config(path, env={}).backend == "triton"
    env = {"SSU_BACKEND": "flashinfer,reference"}
    config = ssu.load_config(path, env=env)
    assert config.backend == ("flashinfer", "reference") and "SSU_BACKEND" in config.source
    config = ssu.load_config(path, env=env, backend="reference")
    assert config.backend == "reference" and config.source == "argument"


@pytest.mark.parametrize(
    "text, pattern",
    [
        ('[ssu]\nbakend = "triton"\n', r"ssu\.bakend: unknown option \(did you mean 'backend'\?\)"),
        ("[ssu]\nbackend = 3\n", r"ssu\.backend: expected a string or a list of strings, got 3"),
        ('[ssu]\nvalidate = "sometimes"\n', r"ssu\.validate: expected true or false or one of 'full', got 'sometimes'"),
        ("[ssu]\nbackend = []\n", r"names must be non-empty"),
        ('[ssu]\nbackend = ["auto", "triton"]\n', r"\"auto\" stands alone"),
        ('[ssu]\nbackend = ["triton", "triton"]\n', r"names a backend twice"),
        ("[ssu]\nbackends = 3\n", r"expected a table"),
        ("[ssu.backends]\ntriton = 4\n", r"ssu\.backends\.triton: expected a table of options"),
        ('[ssu]\nbackend = "triton\n', r"invalid TOML: .*\(at line 2, column 18\)"),
        ('[sus]\nbackend = "x"\n', r"unknown top-level key 'sus' \(did you mean 'ssu'\?\)"),
        ('backend = "x"\n', r"unknown top-level key 'backend'"),
        ("", r"no \[ssu\] table"),
    ],
)
def test_bad_files(tmp_path, text, pattern):
    path = write(tmp_path, text)
    with pytest.raises(ssu.ConfigError, match=pattern) as info:
        ssu.load_config(path, env={})
    assert str(path) in str(info.value)


TABLE_FORMS = [
    ("ssu.toml", "ssu = 3\n", "ssu must be a table (a [ssu] header with keys under it), got the integer 3"),
    (
        "ssu.toml",
        "[[ssu]]\nbackend = 'x'\n",
        "ssu must be a table (a [ssu] header with keys under it), got an array of tables ([[ssu]])",
    ),
    ("pyproject.toml", "tool = 3\n", "tool must be a table (a [tool] header with keys under it), got the integer 3"),
    (
        "pyproject.toml",
        '[tool]\nssu = "x"\n',
        "tool.ssu must be a table (a [tool.ssu] header with keys under it), got the string 'x'",
    ),
]


@pytest.mark.parametrize("name, text, message", TABLE_FORMS, ids=["ssu=3", "[[ssu]]", "tool=3", "tool.ssu=x"])
def test_a_file_whose_ssu_or_tool_is_no_table_is_refused_by_key(tmp_path, monkeypatch, name, text, message):
    """Given, or found in the working directory as an engine plugin's configuration lookup finds it."""
    path = write(tmp_path, text, name)
    with pytest.raises(ssu.ConfigError) as info:
        ssu.load_config(path, env={})
    assert str(info.value) == f"{path}: {message}"
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ssu.ConfigError) as info:
        ssu.load_config(env={})
    assert str(info.value) == f"{path}: {message}"
    from ssu.integrations.engines import configured  # what an engine plugin checks where it loads

    monkeypatch.delenv("SSU_BACKEND", raising=False)

    with pytest.raises(ssu.ConfigError) as info:
        configured()
    assert str(info.value) == f"{path}: {message}"


def test_missing_file_names_its_path(tmp_path):
    with pytest.raises(ssu.ConfigError, match=f"config file not found: {tmp_path / 'nope.toml'}"):
        ssu.load_config(tmp_path / "nope.toml")


def test_pyproject_without_table(tmp_path):
    path = write(tmp_path, '[project]\nname = "x"\n', "pyproject.toml")
    with pytest.raises(ssu.ConfigError, match=r"no \[tool\.ssu\] table"):
        ssu.load_config(path)


def test_bad_environment_value():
    with pytest.raises(ssu.ConfigError, match="SSU_BACKEND="):
        ssu.load_config(search=False, env={"SSU_BACKEND": "auto,triton"})


@pytest.mark.parametrize(
    "fields, pattern",
    [
        (dict(nheads=6, ngroups=4), "not a multiple of ngroups"),
        (dict(nheads=0), "positive integer"),
        (dict(state_dtype="int4"), "not a dtype ssu knows"),
        (dict(state_dtype="fp64"), "not a state cache dtype"),
        (dict(tokens_per_step=4), "needs speculative=True"),
        (dict(pad_slot_id=0), "reserves the only slot"),
        (dict(pad_slot_id=1.5), "must be an integer"),
        (dict(speculative=1), "must be true or false"),
    ],
)
def test_bad_problems(fields, pattern):
    base = dict(nheads=8, headdim=4, dstate=4, ngroups=2)
    base.update(fields)
    with pytest.raises(ssu.ConfigError, match=pattern):
        ssu.Problem(**base)


def test_problem_accepts_torch_dtypes():
    import torch

    p = ssu.Problem(nheads=8, headdim=4, dstate=4, state_dtype=torch.bfloat16, input_dtype=torch.float16)
    assert (p.state_dtype, p.input_dtype) == ("bf16", "fp16")
