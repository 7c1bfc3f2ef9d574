"""Every code block in README.md and docs/ runs as written.

- ``python`` blocks are executed, each in a fresh namespace and a scratch working directory;
- ``toml`` blocks are configurations: loaded, and checked as ``ssu check-config`` checks them;
- ``bash`` blocks: each ``ssu ...`` / ``python3 -m ssu ...`` command is run (a line's ``&&``
  parts one by one); installing (``pip``), changing directory and running pytest are left out:
  the test environment is the installed one.

A block preceded by the line ``<!-- fragment -->`` is a piece of a larger program shown for its
shape (it needs a GPU, a model, or the names around it) and is not run.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?P<before>[^\n]*)\n```(?P<lang>\w+)\n(?P<body>.*?)\n```", re.S)


def blocks():
    for path in DOCS:
        text = path.read_text()
        for match in FENCE.finditer(text):
            if match["before"].strip() == "<!-- fragment -->":
                continue
            line = text[: match.start("body")].count("\n") + 1
            yield pytest.param(match["lang"], match["body"], id=f"{path.name}:{line}")


def _commands(body: str):
    for line in body.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in line.split("&&"):
            words = shlex.split(part.strip().strip("()"))
            if words[:1] == ["ssu"]:
                yield [sys.executable, "-m", "ssu", *words[1:]]
            elif words[:3] in (["python3", "-m", "ssu"], ["python", "-m", "ssu"]):
                yield [sys.executable, "-m", "ssu", *words[3:]]


@pytest.mark.parametrize("lang, body", list(blocks()))
def test_block_runs(lang, body, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if lang == "python":
        exec(compile(body, "<doc block>", "exec"), {"__name__": "__doc_block__"})  # noqa: S102
    elif lang == "toml":
        import ssu
        from ssu.cli.main import main

        (tmp_path / "ssu.toml").write_text(body if body.lstrip().startswith("[ssu") else f"[ssu]\n{body}")
        ssu.load_config(tmp_path / "ssu.toml", env={})
        assert main(["check-config", str(tmp_path / "ssu.toml")]) == 0
    elif lang in ("bash", "sh", "console"):
        env = dict(os.environ)
        env.pop("TRITON_INTERPRET", None)
        for command in _commands(body):
            result = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
            assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr[-2000:])


def test_the_docs_have_runnable_blocks():
    assert sum(1 for _ in blocks()) >= 5


def _summary(path: Path) -> str:
    text = path.read_text()
    start, end = text.find("<!-- summary"), text.find("<!-- /summary -->")
    assert 0 <= start < end, f"{path.name} has no <!-- summary ... --> ... <!-- /summary --> block"
    return text[start:end]


def test_the_readme_quotes_the_benchmark_summary_word_for_word():
    """The README's figures are docs/benchmarks.md's summary: one source for every number."""
    assert _summary(ROOT / "README.md") == _summary(ROOT / "docs" / "benchmarks.md"), (
        "README.md's summary block differs from docs/benchmarks.md's: copy the docs' block into the README"
    )
