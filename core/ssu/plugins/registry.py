"""Backend discovery and loading.

Discovery reads the ``ssu.backends`` entry points from installed distributions' metadata and
imports nothing. A backend's module is imported only when it is selected or probed, then
registered alone in its own pluggy ``PluginManager`` (so its lifecycle hooks are the only ones
that run), checked for misspelled hooks, missing required hooks and a compatible plugin API.

Environment filters, applied before any import:
``SSU_PLUGINS=a,b`` (allowlist) and ``SSU_DISABLE_PLUGINS=c`` (denylist).
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import re
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional

import attrs
import pluggy

from ..contract import hookspecs
from ..contract.errors import (
    BackendBrokenError,
    BackendDisabledError,
    BackendIncompatibleError,
    BackendNotInstalledError,
    SSUWarning,
    UnknownBackendError,
)
from .firstparty import CORE_DISTRIBUTION, FIRST_PARTY, RESERVED, install_hint
from ..contract.options import did_you_mean
from ..contract.records import AVAILABLE, PLUGIN_API_VERSION, Availability, BackendInfo, BackendSpec

GROUP = "ssu.backends"
ENV_ALLOW = "SSU_PLUGINS"
ENV_DENY = "SSU_DISABLE_PLUGINS"


def normalize_distribution(name: str) -> str:
    """PEP 503 form of a distribution name (``ssu_core`` -> ``ssu-core``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_backend_error(name: str, installed: list[str]):
    """The error for a backend name that is not installed: a first-party backend gets its pip
    command, any other name the closest match and the installed list."""
    if name in FIRST_PARTY:
        return BackendNotInstalledError(f"backend {name!r} is not installed; install it with `{install_hint(name)}`")
    known = sorted(set(installed) | set(FIRST_PARTY))
    return UnknownBackendError(
        f"unknown backend {name!r}{did_you_mean(name, known)}. Installed backends: {', '.join(installed) or 'none'}; "
        f"first-party backends: {', '.join(FIRST_PARTY)}. Run `ssu backends` to list them with their status; "
        f"a third-party backend is installed with pip and registers itself under the entry-point group 'ssu.backends'."
    )


def _names(value: str) -> set[str]:
    return {n.strip() for n in value.split(",") if n.strip()}


@attrs.frozen
class Discovered:
    """An entry point found in metadata: nothing imported yet."""

    name: str
    distribution: str
    version: str
    module: str
    load: Callable[[], Any] = attrs.field(eq=False, repr=False)
    clash: tuple = ()  # other distributions that register the same name


@attrs.define(eq=False)
class LoadedBackend:
    """A backend whose module is imported and whose hooks are validated."""

    found: Discovered
    spec: BackendSpec
    pm: pluggy.PluginManager

    @property
    def name(self) -> str:
        """The backend's name as its spec declares it."""
        return self.spec.name

    @property
    def hook(self):
        """The plugin manager's hook caller (lifecycle hooks of this backend only)."""
        return self.pm.hook

    def probe(self, device: str) -> Availability:
        """Whether the backend runs on ``device``; a probe that raises becomes an unavailable record, not a crash."""
        try:
            result = self.pm.hook.ssu_probe(device=device)
        except Exception as exc:  # a probe must not crash the host
            return Availability(
                False, f"its ssu_probe hook raised {type(exc).__name__}: {exc}", "report this to the backend's authors"
            )
        return AVAILABLE if result is None else result


def _api_problem(declared: str) -> Optional[str]:
    """Why a declared plugin API version cannot be served (None: it can)."""
    try:
        major, minor = (int(p) for p in str(declared).split(".")[:2])
    except ValueError:
        return f"declares plugin API version {declared!r}, which is not MAJOR.MINOR"
    core_major, core_minor = (int(p) for p in PLUGIN_API_VERSION.split("."))
    if major != core_major:
        return f"targets plugin API {declared}, this ssu-core serves {PLUGIN_API_VERSION} (major differs)"
    if minor > core_minor:
        return f"targets plugin API {declared}, newer than this ssu-core's {PLUGIN_API_VERSION}; upgrade ssu-core"
    return None


def discovered(entry_point) -> Discovered:
    """An entry point as a :class:`Discovered` backend (its distribution from metadata)."""
    dist = getattr(entry_point, "dist", None)
    name = normalize_distribution(dist.name) if dist is not None else "<unknown>"
    version = dist.version if dist is not None else "unknown"
    return Discovered(entry_point.name, name, version, entry_point.value, entry_point.load)


def without_reserved(items: Iterable[Discovered]) -> list[Discovered]:
    """``items`` without a ``reference`` from another distribution than ssu-core (warned about)."""
    kept = []
    for item in items:
        if item.name == RESERVED and item.distribution != CORE_DISTRIBUTION:
            warnings.warn(
                f"ignoring backend 'reference' registered by {item.distribution}: that name is reserved "
                "for ssu-core's built-in backend",
                SSUWarning,
                stacklevel=3,
            )
            continue
        kept.append(item)
    return kept


def by_name(items: Iterable[Discovered]) -> dict[str, Discovered]:
    """One backend per name: the same distribution seen twice (an editable install) counts once;
    a name registered by two distributions is kept with the others in ``clash``."""
    found: dict[str, Discovered] = {}
    for item in items:
        previous = found.get(item.name)
        if previous is None:
            found[item.name] = item
        elif previous.distribution != item.distribution and item.distribution not in previous.clash:
            found[item.name] = attrs.evolve(previous, clash=previous.clash + (item.distribution,))
    return found


def import_plugin(found: Discovered) -> Any:
    """Import a discovered backend's module; a failure is a :class:`BackendBrokenError` naming the
    backend, its distribution and the import error."""
    try:
        return found.load()
    except Exception as exc:
        raise BackendBrokenError(
            f"backend {found.name!r} ({found.distribution} {found.version}) is installed but failed to import "
            f"{found.module}: {type(exc).__name__}: {exc}; "
            f"fix the import error (often a missing or mismatched dependency), or reinstall {found.distribution}"
        ) from exc


def validate_plugin(found: Discovered, plugin: Any, *, expected: Optional[str]) -> LoadedBackend:
    """Register ``plugin`` alone in a plugin manager and check it: hook names and arguments,
    required hooks, its ``BackendSpec``, the name it declares (``expected``, when registered under
    an entry point), its plugin API version, and the hooks its capabilities need."""
    label = f"backend {found.name!r} ({found.distribution} {found.version}, {found.module})"
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    try:
        pm.register(plugin, name=found.name)
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise BackendBrokenError(f"{label} has an invalid hook implementation: {exc}") from exc
    missing = [h for h in hookspecs.REQUIRED_HOOKS if not getattr(pm.hook, h).get_hookimpls()]
    if missing:
        raise BackendBrokenError(f"{label} does not implement the required hook(s) {', '.join(missing)}")
    try:
        spec = pm.hook.ssu_backend()
    except Exception as exc:
        raise BackendBrokenError(f"{label}: its ssu_backend hook raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(spec, BackendSpec):
        raise BackendBrokenError(f"{label}: ssu_backend returned {type(spec).__name__}, not ssu.BackendSpec")
    if expected is not None and spec.name != expected:
        raise BackendBrokenError(
            f"{label} declares the name {spec.name!r} but is registered as {expected!r}; the two must agree"
        )
    problem = _api_problem(spec.api_version)
    if problem:
        raise BackendIncompatibleError(f"{label} {problem}")
    if spec.capabilities.speculative and not pm.hook.ssu_commit.get_hookimpls():
        raise BackendBrokenError(f"{label} declares speculative decoding but does not implement ssu_commit")
    if spec.capabilities.adopt_state and not pm.hook.ssu_adopt_state.get_hookimpls():
        raise BackendBrokenError(f"{label} declares adopt_state but does not implement ssu_adopt_state")
    if spec.capabilities.engine_calls and not pm.hook.ssu_engine_call.get_hookimpls():
        raise BackendBrokenError(
            f"{label} declares engine call forms ({', '.join(sorted(spec.capabilities.engine_calls))}) but does not "
            "implement ssu_engine_call"
        )
    return LoadedBackend(attrs.evolve(found, name=spec.name), spec, pm)


class Registry:
    """Discovered backends, filters, and the backends loaded so far.

    ``entry_points`` (an iterable of ``importlib.metadata.EntryPoint``) and ``env`` can be
    injected for tests; by default installed metadata and ``os.environ`` are read.
    """

    def __init__(self, entry_points: Optional[Iterable[Any]] = None, env: Optional[Mapping[str, str]] = None) -> None:
        self._entry_points = entry_points
        self._env = env
        self._found: Optional[dict[str, Discovered]] = None
        self._local: dict[str, Discovered] = {}
        self._loaded: dict[str, LoadedBackend] = {}
        self._broken: dict[str, BackendBrokenError] = {}

    # discovery -------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Forget discovered and loaded backends (after installing or removing one)."""
        self._found = None
        self._loaded.clear()
        self._broken.clear()

    @property
    def env(self) -> Mapping[str, str]:
        """The environment the registry reads SSU_* variables from (os.environ unless one was given)."""
        return os.environ if self._env is None else self._env

    def _read_entry_points(self) -> list:
        if self._entry_points is not None:
            return list(self._entry_points)
        return list(metadata.entry_points(group=GROUP))

    def discover(self) -> dict[str, Discovered]:
        """Backends by name, from metadata only. Clashes and reserved names warn, never crash."""
        if self._found is None:
            self._found = by_name(without_reserved(discovered(ep) for ep in self._read_entry_points()))
            for item in self._found.values():
                if item.clash:
                    warnings.warn(_clash_message(item), SSUWarning, stacklevel=2)
            for message in self.filter_warnings():
                warnings.warn(message, SSUWarning, stacklevel=2)
        return {**self._found, **self._local}

    def filter_warnings(self) -> list[str]:
        """A line for each name in ``SSU_PLUGINS`` / ``SSU_DISABLE_PLUGINS`` that matches no
        installed backend (a typo there disables or keeps backends silently otherwise)."""
        known = set(self._found or {}) | set(self._local)
        lines = []
        for variable in (ENV_ALLOW, ENV_DENY):
            for name in sorted(_names(self.env.get(variable, "")) - known):
                effect = "every backend not named there is disabled" if variable == ENV_ALLOW else "it disables nothing"
                lines.append(
                    f"{variable} names {name!r}, which is no installed backend"
                    f"{did_you_mean(name, known)}; {effect}. Installed: {', '.join(sorted(known)) or 'none'}"
                )
        return lines

    def register(self, plugin: Any, *, distribution: str = "<in-process>", version: str = "") -> str:
        """Register a backend object or module defined in this process (tests, benchmarks, an
        engine's private kernel). Returns its name. It is loaded and validated at once."""
        module = getattr(plugin, "__name__", type(plugin).__name__)
        loaded = validate_plugin(
            Discovered(module, distribution, version, module, lambda: plugin), plugin, expected=None
        )
        name = loaded.spec.name
        if name == RESERVED or name in self.discover():
            raise BackendBrokenError(f"cannot register backend {name!r} from {module}: that name is already taken")
        self._local[name] = loaded.found
        self._loaded[name] = loaded
        return name

    def unregister(self, name: str) -> None:
        """Forget a backend added with :meth:`register`."""
        self._local.pop(name, None)
        self._loaded.pop(name, None)

    # filters ---------------------------------------------------------------------------------
    def disabled_reason(self, name: str) -> Optional[str]:
        """Why ``name`` is switched off by the environment (None: it is not)."""
        allow = _names(self.env.get(ENV_ALLOW, ""))
        deny = _names(self.env.get(ENV_DENY, ""))
        if name in deny:
            return f"disabled by {ENV_DENY}={self.env[ENV_DENY]!r}; remove {name!r} from it to use it"
        if allow and name not in allow:
            return f"not in {ENV_ALLOW}={self.env[ENV_ALLOW]!r}; add {name!r} to it to use it"
        return None

    # loading ---------------------------------------------------------------------------------
    def load(self, name: str) -> LoadedBackend:
        """Import and validate backend ``name`` (discovered and enabled). Cached per process.

        Raises :class:`BackendDisabledError`, :class:`BackendBrokenError` or
        :class:`BackendIncompatibleError`, each naming the backend and its distribution.
        """
        discovered = self.discover()
        if name not in discovered:
            raise missing_backend_error(name, sorted(discovered))
        found = discovered[name]
        reason = self.disabled_reason(name)
        if reason:
            raise BackendDisabledError(f"backend {name!r} ({found.distribution}) is {reason}")
        if name in self._loaded:
            return self._loaded[name]
        if name in self._broken:
            raise self._broken[name]
        if found.clash:
            raise BackendBrokenError(_clash_message(found))
        try:
            loaded = validate_plugin(found, import_plugin(found), expected=name)
        except BackendIncompatibleError:
            raise
        except BackendBrokenError as error:
            self._broken[name] = error
            raise
        self._loaded[name] = loaded
        return loaded

    # listing ---------------------------------------------------------------------------------
    def info(self, name: str, *, probe: bool = False, device: str = "cpu") -> BackendInfo:
        """Status of one backend; ``probe=True`` imports it and runs its availability probe."""
        found = self.discover()[name]
        base = BackendInfo(found.name, found.distribution, found.version, found.module, "installed")
        reason = self.disabled_reason(name)
        if reason:
            return attrs.evolve(base, status="disabled", reason=reason)
        if found.clash:
            return attrs.evolve(base, status="broken", reason=_clash_message(found))
        if not probe and name not in self._loaded:
            return base
        try:
            loaded = self.load(name)
        except BackendIncompatibleError as exc:
            return attrs.evolve(base, status="incompatible", reason=str(exc))
        except BackendBrokenError as exc:
            return attrs.evolve(base, status="broken", reason=str(exc))
        spec = loaded.spec
        base = attrs.evolve(base, description=spec.description, capabilities=spec.capabilities)
        if not probe:
            return attrs.evolve(base, status="installed")
        availability = loaded.probe(device)
        if availability.available:
            return attrs.evolve(base, status="available")
        return attrs.evolve(base, status="unavailable", reason=availability.message())

    def list(self, *, probe: bool = False, device: str = "cpu") -> list[BackendInfo]:
        """Every discovered backend, ``reference`` last. Without ``probe`` nothing is imported."""
        names = sorted(self.discover(), key=lambda n: (n == RESERVED, n))
        return [self.info(n, probe=probe, device=device) for n in names]


def _clash_message(found: Discovered) -> str:
    return (
        f"backend name {found.name!r} is registered by more than one distribution: "
        f"{', '.join((found.distribution,) + found.clash)}; uninstall all but one of them"
    )


_default: Optional[Registry] = None


def default_registry() -> Registry:
    """The process-wide registry used by :func:`ssu.open` and :func:`ssu.list_backends`."""
    global _default
    if _default is None:
        _default = Registry()
    return _default


def list_backends(*, probe: bool = False, device: str = "cpu") -> list[BackendInfo]:
    """Discovered backends with their status. Imports none of them unless ``probe=True``
    (which imports each backend's plugin module and runs its availability probe for ``device``;
    plugin modules import their kernel libraries only when a kernel is opened)."""
    return default_registry().list(probe=probe, device=device)
