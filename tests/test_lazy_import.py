"""Listing and configuring backends imports no GPU library (proved in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = [
    "torch",
    "triton",
    "flashinfer",
    "cupy",
    "ssu_backend_triton",
    "ssu_backend_flashinfer",
    "ssu_backend_flashinfer_replayssm",
    "ssu.reference",
]


def run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_list_backends_imports_nothing_heavy():
    out = run(f"""
        import sys, ssu
        infos = ssu.list_backends()
        cfg = ssu.load_config(search=False)
        assert any(i.name == "reference" for i in infos)
        print(sorted(m for m in {HEAVY!r} if m in sys.modules))
    """)
    assert out.strip() == "[]"


def test_probing_imports_plugin_modules_but_no_kernel_library():
    out = run("""
        import sys, ssu
        ssu.list_backends(probe=True)
        print(sorted(m for m in ["triton", "flashinfer", "cupy"] if m in sys.modules))
    """)
    assert out.strip() == "[]"
