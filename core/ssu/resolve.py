"""Choosing the backend for a problem, with a reason for every candidate.

A backend the user named is never replaced silently: with one name, its failure is the error;
with a list, each name is tried in order and every rejection is kept for ``explain``; with
``"auto"``, every enabled backend is tried by priority, ``reference`` last.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs

from .config import AUTO, Config
from .errors import BackendError, BackendUnavailableError, ConfigError
from .firstparty import FIRST_PARTY, RESERVED
from .options import build, did_you_mean
from .problem import Problem
from .registry import LoadedBackend, Registry, missing_backend_error


@attrs.frozen
class Candidate:
    """One line of the resolution trace."""

    name: str
    outcome: str  # "selected" | "rejected" | "not tried"
    reason: str = ""


@attrs.frozen
class Resolution:
    """Which backend serves the problem, and why each other candidate did not."""

    requested: tuple
    source: str
    problem: Problem
    selected: Optional[str]
    trace: tuple

    def explain(self) -> str:
        lines = [f"problem: {self.problem.describe()}",
                 f"requested: {', '.join(self.requested)} (from {self.source})"]
        for c in self.trace:
            mark = {"selected": "->", "rejected": " x", "not tried": " ."}[c.outcome]
            lines.append(f"{mark} {c.name}: {c.outcome}" + (f": {c.reason}" if c.reason else ""))
        return "\n".join(lines)


def _options(loaded: LoadedBackend, config: Config) -> Any:
    """Validate the backend's option table with its own options class."""
    name = loaded.name
    table = config.options_for(name)
    cls = loaded.spec.options_class
    if cls is None:
        if table:
            raise ConfigError(f"ssu.backends.{name}: backend {name!r} takes no options, got {', '.join(table)}")
        return None
    return build(cls, table, f"ssu.backends.{name}")


def _evaluate(name: str, problem: Problem, config: Config, registry: Registry) -> tuple[LoadedBackend, Any]:
    """Load and check one candidate: returns it with its options, or raises why not."""
    loaded = registry.load(name)  # raises the not-installed / unknown / broken / disabled errors
    options = _options(loaded, config)
    availability = loaded.probe(problem.device)
    if not availability.available:
        raise BackendUnavailableError(f"backend {name!r} is installed but unavailable on {problem.device}: "
                                      f"{availability.message()}")
    reasons = loaded.spec.capabilities.check(problem)
    if not reasons:
        verdict = loaded.hook.ssu_supports(problem=problem, options=options)
        if verdict is not None and not verdict.ok:
            reasons = list(verdict.reasons) or ["rejected by its ssu_supports hook"]
    if reasons:
        raise BackendUnavailableError(f"backend {name!r} does not support this problem ({problem.describe()}): "
                                      + "; ".join(reasons))
    return loaded, options


def _check_option_tables(config: Config, registry: Registry) -> None:
    known = set(registry.discover()) | set(FIRST_PARTY)
    for name in config.backends:
        if name not in known:
            raise ConfigError(f"ssu.backends.{name}: no backend named {name!r}{did_you_mean(name, known)}; "
                              f"known backends: {', '.join(sorted(known))}")


def _auto_order(registry: Registry, trace: list) -> list[str]:
    """Enabled backends by descending priority, ``reference`` last; broken ones go to the trace."""
    ranked = []
    for name in registry.discover():
        reason = registry.disabled_reason(name)
        if reason:
            trace.append(Candidate(name, "rejected", reason))
            continue
        try:
            ranked.append((name == RESERVED, -registry.load(name).spec.priority, name))
        except BackendError as exc:
            trace.append(Candidate(name, "rejected", str(exc)))
    return [name for *_, name in sorted(ranked)]


def resolve(config: Config, problem: Problem, registry: Registry) -> tuple[LoadedBackend, Any, Resolution]:
    """Pick the backend for ``problem``: returns the loaded backend, its options and the trace."""
    _check_option_tables(config, registry)
    requested = config.candidates
    trace: list[Candidate] = []
    if requested == (AUTO,):
        order = _auto_order(registry, trace)
    else:
        order = list(requested)
        installed = sorted(registry.discover())
        for name in order:  # a typo in a fallback list must not fall through silently
            if name not in installed and name not in FIRST_PARTY:
                raise missing_backend_error(name, installed)
    errors = []
    for i, name in enumerate(order):
        try:
            loaded, options = _evaluate(name, problem, config, registry)
        except BackendError as exc:
            if len(requested) == 1 and requested != (AUTO,):
                raise
            errors.append(exc)
            trace.append(Candidate(name, "rejected", str(exc)))
            continue
        trace.append(Candidate(name, "selected"))
        trace.extend(Candidate(rest, "not tried", f"{name} comes first") for rest in order[i + 1:])
        return loaded, options, Resolution(requested, config.source, problem, name, tuple(trace))
    details = "\n".join(f"  - {c.name}: {c.reason}" for c in trace if c.outcome == "rejected")
    error = BackendUnavailableError(
        f"no backend of {', '.join(requested)} can serve this problem ({problem.describe()}):\n{details}"
    )
    error.resolution = Resolution(requested, config.source, problem, None, tuple(trace))
    raise error


def explain(config: Config, problem: Problem, registry: Registry) -> Resolution:
    """Like :func:`resolve` but never raises for backend reasons: the trace says it all."""
    try:
        return resolve(config, problem, registry)[2]
    except BackendError as exc:
        if getattr(exc, "resolution", None) is not None:
            return exc.resolution
        return Resolution(config.candidates, config.source, problem, None,
                          (Candidate(", ".join(config.candidates), "rejected", str(exc)),))
