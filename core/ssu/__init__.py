"""ssu: a plugin framework for the Mamba2 selective state update (SSU).

Engines open a kernel for a problem and call its step on the hot path::

    import ssu
    kernel = ssu.open(ssu.load_config(), ssu.Problem(nheads=128, headdim=64, dstate=128, ngroups=8))
    state = kernel.allocate_state(num_layers=1)
    out = kernel.step(state, x, dt, A, B, C, slots)

Backends are found through the ``ssu.backends`` entry-point group; importing ``ssu`` or listing
backends imports no GPU library (and not even torch).
"""

from __future__ import annotations

from . import _moved
from .contract.errors import (
    BackendBrokenError,
    BackendDisabledError,
    BackendError,
    BackendIncompatibleError,
    BackendNotInstalledError,
    BackendUnavailableError,
    ConfigError,
    InputError,
    NotServedError,
    SSUError,
    SSUWarning,
    UnknownBackendError,
)
from .contract.hookspecs import hookimpl
from .contract.problem import Problem
from .contract.records import (
    ACCEPT,
    AVAILABLE,
    CORE_VERSION,
    PLUGIN_API_VERSION,
    Availability,
    BackendInfo,
    BackendSpec,
    Capabilities,
    Context,
    State,
    Verdict,
)
from .measure import traffic
from .plugins.config import Config, load_config
from .plugins.registry import default_registry, list_backends
from .runtime.kernel import Kernel, open_kernel
from .dropin import selective_state_update

_moved.install()  # the root module paths (ssu.records, ssu.slot_state, ...) import too

open = open_kernel  # noqa: A001 - ``ssu.open(config, problem)`` is the public spelling

__version__ = CORE_VERSION

__all__ = [
    "ACCEPT",
    "AVAILABLE",
    "Availability",
    "BackendBrokenError",
    "BackendDisabledError",
    "BackendError",
    "BackendIncompatibleError",
    "BackendInfo",
    "BackendNotInstalledError",
    "BackendSpec",
    "BackendUnavailableError",
    "Capabilities",
    "Config",
    "ConfigError",
    "Context",
    "InputError",
    "Kernel",
    "NotServedError",
    "PLUGIN_API_VERSION",
    "Problem",
    "SSUError",
    "SSUWarning",
    "State",
    "UnknownBackendError",
    "Verdict",
    "default_registry",
    "explain",
    "hookimpl",
    "list_backends",
    "load_config",
    "open",
    "register_backend",
    "selective_state_update",
    "traffic",
]


def register_backend(plugin) -> str:
    """Register an in-process backend (a module or object with ``ssu.hookimpl`` functions) in the
    default registry, without packaging it; returns its name. For tests, benchmarks and private
    engine kernels; published backends use the ``ssu.backends`` entry-point group."""
    return default_registry().register(plugin)


def explain(config: Config | None = None, problem: Problem | None = None) -> str:
    """Which backend would serve ``problem`` under ``config`` and why each other was rejected."""
    from .plugins.resolve import explain as _explain

    if problem is None:
        raise ConfigError("ssu.explain needs a Problem")
    return _explain(load_config() if config is None else config, problem, default_registry()).explain()


def __getattr__(name: str):
    """An old module name as an attribute (``ssu.errors`` after ``import ssu``; :mod:`ssu._moved`)."""
    module = _moved.moved_attribute(name)
    if module is None:
        raise AttributeError(f"module 'ssu' has no attribute {name!r}")
    return module
