"""vLLM's and SGLang's own SSU Triton kernels, run unchanged on the CPU in Triton's interpreter,
as a second oracle for the engine call forms (docs/spec.md, "Engine call forms").

Each engine's kernel is read at run time out of its wheel (downloaded with ``pip download
--no-deps``; nothing of it is kept in this repository) by :mod:`ssu.bench.engine_kernels`, which
says what it stands in for while the kernel executes. On the CPU vLLM's device has no tuned
launch config (vLLM's default heuristic applies) and SGLang launches without PDL; where Triton's
interpreter refuses a broadcast scalar mask, masked loads and stores view it as bool
(:func:`ssu.bench.engine_kernels.interpreter_masks`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from ssu.bench import engine_kernels

VLLM = ("vllm", "0.34.0")
SGLANG = ("sglang", "0.5.23")
#: where the wheels are looked for: $SSU_ENGINE_WHEELS, else .engines/ at the repository's root
WHEELS = Path(os.environ.get("SSU_ENGINE_WHEELS", Path(__file__).resolve().parents[1] / ".engines"))
_loaded: dict = {}


def wheel(name: str, version: str) -> Optional[Path]:
    """The engine's wheel in :data:`WHEELS`, or None."""
    found = sorted(WHEELS.glob(f"{name}-{version}-*.whl")) if WHEELS.is_dir() else []
    return found[0] if found else None


def missing(name: str, version: str) -> str:
    return (
        f"{name} {version}'s wheel is not in {WHEELS}: pip download --no-deps {name}=={version} -d {WHEELS} "
        "(or set SSU_ENGINE_WHEELS)"
    )


def vllm_ssu(archive: Path):
    """vLLM's ``selective_state_update`` (its Triton kernel), runnable on the CPU in the interpreter."""
    return _kernel("vllm", archive)


def sglang_ssu(archive: Path):
    """SGLang's ``selective_state_update`` (its Triton kernel), runnable on the CPU in the interpreter."""
    return _kernel("sglang", archive)


def _kernel(engine: str, archive: Path):
    key = (engine, str(archive))
    if key not in _loaded:
        engine_kernels.interpreter_masks()
        _loaded[key] = engine_kernels.load(engine, str(archive), device_name=lambda: "cpu_interpreter").call
    return _loaded[key]
