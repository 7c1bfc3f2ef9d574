"""Every Triton kernel of the first-party backends reads only the module globals a compiled kernel
may read.

Under ``TRITON_INTERPRET=1`` a kernel is plain Python and reads any global; compiled for a GPU,
Triton refuses a global that is not a ``tl.constexpr``, a module, another jitted function or a
``triton.language`` object, and the kernel fails at its first launch. CI has no GPU, so the rule is
held here, on the kernels' source.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import inspect
import pkgutil
import textwrap
import types

import pytest

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

#: what ``@triton.jit`` makes, compiled or (TRITON_INTERPRET=1, as the tests run) interpreted
JITTED = (JITFunction, InterpretedFunction)

PACKAGES = ("ssu_backend_triton", "ssu_backend_flashinfer")


def _modules():
    for package_name in PACKAGES:
        package = pytest.importorskip(package_name)
        for info in pkgutil.walk_packages(package.__path__, f"{package_name}."):  # subpackages too
            try:
                yield importlib.import_module(info.name)
            except ImportError:  # a module needing a library this machine lacks holds no kernel we build
                continue


def _kernels():
    seen = {}
    for module in _modules():
        for name, value in vars(module).items():
            if isinstance(value, JITTED) and value.fn.__module__ == module.__name__:
                seen[f"{module.__name__}.{name}"] = (module, value)
    return seen


KERNELS = _kernels()


def _allowed(value) -> bool:
    """Triton's rule for a global read inside a compiled kernel."""
    return (
        isinstance(value, (types.ModuleType, tl.constexpr, tl.dtype, *JITTED))
        or getattr(value, "__triton_builtin__", False)
        or getattr(value, "__module__", "").startswith("triton.language")
        or (isinstance(value, type) and issubclass(value, tuple) and hasattr(value, "_fields"))
    )


def _globals_read(fn) -> set[str]:
    """Names a function's body reads that are neither its arguments nor assigned in it (its
    decorator runs in Python, not in the kernel)."""
    func = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    nodes = [node for statement in func.body for node in ast.walk(statement)]
    local = {a.arg for a in ast.walk(func.args) if isinstance(a, ast.arg)}
    local |= {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - local


def test_the_backends_have_kernels():
    assert any(name.startswith("ssu_backend_triton.") for name in KERNELS)
    assert any(name.startswith("ssu_backend_flashinfer.") for name in KERNELS)


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_a_kernel_reads_only_globals_a_compiled_kernel_may_read(name):
    module, kernel = KERNELS[name]
    wrong = sorted(
        f"{g} = {getattr(module, g)!r}"
        for g in _globals_read(kernel.fn)
        if hasattr(module, g) and not hasattr(builtins, g) and not _allowed(getattr(module, g))
    )
    assert not wrong, f"{name} reads globals Triton refuses when it compiles (make them tl.constexpr): {wrong}"
