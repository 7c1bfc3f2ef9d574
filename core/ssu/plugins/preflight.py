"""What a configuration can be checked for before any problem is known.

The backend names it gives (installed, or first-party and so installable), their option tables
and values, and whether each named backend's plugin imports and registers: everything a first
call would find wrong whatever its shapes. An engine plugin runs it where the engine loads the
plugin (:func:`preflight` with ``engine=True``), so that a typo in ``SSU_BACKEND`` stops the engine
at startup instead of at its first request.

Importing a named backend's plugin module (for ``"auto"`` in an engine, every enabled one) is all
it loads: plugin modules import no GPU library (docs/writing-a-backend.md), and availability on a
device is left to the first call of each problem, where an engine plugin passes a problem no
configured backend serves to the engine's own SSU.
"""

from __future__ import annotations

from typing import Optional

from .config import AUTO, Config
from ..contract.errors import BackendDisabledError, BackendError, BackendNotInstalledError
from .registry import Registry, default_registry
from .resolve import (
    _from_where,
    auto_order,
    check_backend_names,
    check_option_tables,
    in_place_refusal,
    validated_options,
)


def preflight(config: Config, registry: Optional[Registry] = None, *, engine: bool = False) -> tuple[str, ...]:
    """Check ``config``'s backend names and options; raise the first error, return notes.

    Raises :class:`~ssu.UnknownBackendError` for a name that no installed or first-party backend
    has, :class:`~ssu.ConfigError` for an option table of an unknown backend or a bad option
    value, and the registry's error for a named backend that is installed but broken, disabled
    (``SSU_PLUGINS`` / ``SSU_DISABLE_PLUGINS``) or built for another plugin API. Each error says
    where the name came from (the file, ``SSU_BACKEND``).

    ``engine``: the configuration serves an engine's own cache (an engine plugin's). Then also a
    named backend that cannot step an engine's cache in place, and a configuration none of whose
    named backends is installed, are errors; a first-party name that is not installed, in a list
    with one that is, is a note (the list falls through it at each first call). ``"auto"`` for an
    engine is an error where no enabled backend can step an engine's cache, and each backend it
    passes over for that reason is a note."""
    registry = default_registry() if registry is None else registry
    try:
        check_backend_names(config, registry)
    except BackendError as exc:
        raise _from_where(exc, config) from None
    check_option_tables(config, registry)
    if config.candidates == (AUTO,):
        return _auto_for_engine(config, registry) if engine else ()
    installed = registry.discover()
    notes = []
    missing = [name for name in config.candidates if name not in installed]
    for name in config.candidates:
        if name in missing:
            continue
        try:
            loaded = registry.load(name)
        except BackendDisabledError as exc:
            if engine:
                raise _from_where(exc, config) from None
            notes.append(str(exc))
            continue
        except BackendError as exc:
            raise _from_where(exc, config) from None
        validated_options(loaded, config)
        if engine:
            _serves_engine_caches(loaded, config)
    if engine and missing:
        if len(missing) == len(config.candidates):
            raise _from_where(BackendNotInstalledError(_not_installed(missing, registry)), config) from None
        notes.extend(f"backend {name!r} is not installed: passed over" for name in missing)
    return tuple(notes)


def _not_installed(missing: list, registry: Registry) -> str:
    """No named backend is installed: the pip command of each."""
    from .firstparty import install_hint

    hints = "; ".join(f"`{install_hint(name)}`" for name in missing)
    installed = ", ".join(sorted(registry.discover())) or "none"
    return f"no named backend is installed ({', '.join(missing)}; installed: {installed}); install with {hints}"


def engine_refusal(loaded) -> Optional[str]:
    """Why backend ``loaded`` (a loaded registry entry) cannot step an engine's cache in place, as
    an engine plugin needs (None: it can): :func:`ssu.plugins.resolve.in_place_refusal`."""
    return in_place_refusal(loaded)


def _auto_for_engine(config: Config, registry: Registry) -> tuple[str, ...]:
    """``backend = "auto"`` for an engine, checked as a named list is: every backend ``auto`` may
    try (enabled and importable, by priority) has valid options, and at least one of them steps
    an engine's cache in place, the others being passed over at each problem (the resolver knows
    the drop-in's needs). Raises where none can; returns a note per backend passed over."""
    trace: list = []
    order = auto_order(registry, trace)
    passed = [f"{c.name}: {c.reason}" for c in trace]
    serving = []
    for name in order:
        loaded = registry.load(name)
        validated_options(loaded, config)
        why = engine_refusal(loaded)
        if why is None:
            serving.append(name)
        else:
            passed.append(f"{name}: {why}")
    if not serving:
        error = BackendError(
            f"auto: no enabled backend can step an engine's cache in place ({'; '.join(passed) or 'none installed'}); "
            "install or enable one that can (such as reference, triton, flashinfer), or name it"
        )
        raise _from_where(error, config) from None
    return tuple(f"auto passes over backend {line}" for line in passed)


def _serves_engine_caches(loaded, config: Config) -> None:
    """Raise :func:`engine_refusal`'s reason, if any, as the configuration's error."""
    why = engine_refusal(loaded)
    if why is not None:
        error = BackendError(
            f"backend {loaded.name!r} {why}: an engine serves its SSU through backends that step its cache "
            "(such as reference, triton, flashinfer); name one of those for the engine"
        )
        raise _from_where(error, config) from None
