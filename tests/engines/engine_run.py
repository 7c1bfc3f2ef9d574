"""Running :mod:`scenario` as the engine would run one of its processes: a subprocess with the
environment given, its ``RESULT`` line parsed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


#: where SGLang's scheduler finds the torchvision it imports (stubs/torchvision says why)
STUBS = HERE / "stubs"


def run(engine: str, tmp_path, **env) -> subprocess.CompletedProcess:
    """Run ``scenario.py engine`` in ``tmp_path`` (no ``ssu.toml`` there unless written) with the
    process environment, ``SSU_BACKEND``, ``VLLM_PLUGINS`` and ``SGLANG_PLUGINS`` removed, plus
    ``env``."""
    environ = {k: v for k, v in os.environ.items() if k not in ("SSU_BACKEND", "VLLM_PLUGINS", "SGLANG_PLUGINS")}
    environ.update(env)
    return subprocess.run(
        [sys.executable, str(HERE / "scenario.py"), engine], capture_output=True, text=True, cwd=tmp_path,
        env=environ, timeout=900,
    )  # fmt: skip


def scenario(engine: str, tmp_path, **env) -> dict:
    """:func:`run`, which must succeed; its ``RESULT`` line parsed."""
    result = run(engine, tmp_path, **env)
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(lines[-1][len("RESULT ") :])
