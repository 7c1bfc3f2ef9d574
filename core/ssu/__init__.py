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

from .config import Config, load_config
from .dropin import selective_state_update
from .errors import (
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
from .hookspecs import hookimpl
from .kernel import Kernel, open_kernel
from .problem import Problem
from .records import (
    ACCEPT,
    AVAILABLE,
    PLUGIN_API_VERSION,
    Availability,
    BackendInfo,
    BackendSpec,
    Capabilities,
    Context,
    State,
    Verdict,
)
from .registry import default_registry, list_backends
from . import traffic

open = open_kernel  # noqa: A001 - ``ssu.open(config, problem)`` is the public spelling

__version__ = "0.1.0"

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
    from .resolve import explain as _explain

    if problem is None:
        raise ConfigError("ssu.explain needs a Problem")
    return _explain(load_config() if config is None else config, problem, default_registry()).explain()
