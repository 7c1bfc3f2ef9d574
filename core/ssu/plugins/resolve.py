"""Choosing the backend for a problem, with a reason for every candidate.

A backend the user named is never replaced silently: with one name, its failure is the error;
with a list, each name is tried in order and every rejection is kept for ``explain``; with
``"auto"``, every enabled backend is tried by priority, ``reference`` last.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import attrs

from .config import AUTO, ENV_BACKEND, Config
from ..contract.errors import BackendError, BackendUnavailableError, ConfigError
from .firstparty import FIRST_PARTY, RESERVED
from ..contract.options import build, did_you_mean, prefixed
from ..contract.problem import Problem
from .registry import LoadedBackend, Registry, missing_backend_error


@attrs.frozen
class Candidate:
    """One line of the resolution trace."""

    name: str
    outcome: str  # "selected" | "rejected" | "not tried" | "not requested"
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
        """The resolution as lines: the problem, what was requested and from where, each candidate's outcome."""
        lines = [f"problem: {self.problem.describe()}", f"requested: {', '.join(self.requested)} (from {self.source})"]
        for c in self.trace:
            mark = {"selected": "->", "rejected": " x", "not tried": " .", "not requested": " ."}[c.outcome]
            lines.append(f"{mark} {c.name}: {c.outcome}" + (f": {c.reason}" if c.reason else ""))
        return "\n".join(lines)


def validated_options(loaded: LoadedBackend, config: Config) -> Any:
    """Validate the backend's option table with its own options class; an error names the
    option's full path and the config file it came from."""
    name = loaded.name
    table = config.options_for(name)
    cls = loaded.spec.options_class
    where = f"{config.path}: " if config.path else ""
    if cls is None:
        if table:
            raise ConfigError(f"{where}ssu.backends.{name}: backend {name!r} takes no options, got {', '.join(table)}")
        return None
    try:
        return build(cls, table, f"ssu.backends.{name}")
    except ConfigError as exc:
        raise ConfigError(prefixed(where, str(exc))) from None


def in_place_refusal(loaded: LoadedBackend) -> Optional[str]:
    """Why backend ``loaded`` cannot serve a caller that steps an engine's own cache and never calls
    ``kernel.sync`` (the drop-in call, and so the engine plugins and the transformers patch), None
    where it can: it does not adopt caches, or it keeps state beside them (it implements
    ``ssu_sync_state``), which the engine's own writes (a prefill) would not reach."""
    if not loaded.spec.capabilities.adopt_state:
        return "does not step an engine's own cache in place (it serves states it allocates)"
    if loaded.hook.ssu_sync_state.get_hookimpls():
        return (
            "keeps state beside the engine's cache (its tensor is current only after kernel.sync), which the "
            "engine's own writes (a prefill) would not reach"
        )
    return None


def _evaluate(
    name: str, problem: Problem, config: Config, registry: Registry, in_place: bool = False
) -> tuple[LoadedBackend, Any, tuple]:
    """Load and check one candidate: returns it with its options and the notes of its accepting
    verdict, or raises why not. ``in_place``: the caller steps the engine's cache and never syncs
    it (:func:`in_place_refusal`)."""
    loaded = registry.load(name)  # raises the not-installed / unknown / broken / disabled errors
    options = validated_options(loaded, config)
    availability = loaded.probe(problem.device)
    if not availability.available:
        raise BackendUnavailableError(
            f"backend {name!r} is installed but unavailable on {problem.device}: {availability.message()}"
        )
    reasons = loaded.spec.capabilities.check(problem)
    if in_place and not reasons and in_place_refusal(loaded):
        reasons = [f"{in_place_refusal(loaded)}: the drop-in call serves backends whose steps keep it current"]
    notes: tuple = ()
    if not reasons:
        verdict = loaded.hook.ssu_supports(problem=problem, options=options)
        if verdict is not None and not verdict.ok:
            reasons = list(verdict.reasons) or ["rejected by its ssu_supports hook"]
        elif verdict is not None:
            notes = tuple(verdict.reasons)
    if reasons:
        raise BackendUnavailableError(
            f"backend {name!r} does not support this problem ({problem.describe()}): " + "; ".join(reasons)
        )
    return loaded, options, notes


def check_option_tables(config: Config, registry: Registry) -> None:
    """Every ``[ssu.backends.<name>]`` table names an installed or first-party backend."""
    known = set(registry.discover()) | set(FIRST_PARTY)
    for name in config.backends:
        if name not in known:
            where = f"{config.path}: " if config.path else ""
            raise ConfigError(
                f"{where}ssu.backends.{name}: no backend named {name!r}{did_you_mean(name, known)}; "
                f"known backends: {', '.join(sorted(known))}"
            )


def check_backend_names(config: Config, registry: Registry) -> None:
    """Every name in ``backend`` is installed or first-party (a typo in a fallback list must not
    fall through silently)."""
    if config.candidates == (AUTO,):
        return
    installed = sorted(registry.discover())
    for name in config.candidates:
        if name not in installed and name not in FIRST_PARTY:
            raise missing_backend_error(name, installed)


def auto_order(registry: Registry, trace: list) -> list[str]:
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


def named_where(config: Config) -> str:
    """Where the configured backend names came from, as a message prefix: ``"ssu.toml: backend: "``
    for a file, ``"SSU_BACKEND: "`` for the environment, nothing for an argument or the default."""
    if config.source.startswith("file ") and config.path:
        return f"{config.path}: backend: "
    if config.source == f"environment {ENV_BACKEND}":
        return f"{ENV_BACKEND}: "
    return ""


def _from_where(exc: BackendError, config: Config) -> BackendError:
    """A copy of ``exc`` (same class, same ``resolution``) whose message starts with where the
    backend name came from (:func:`named_where`)."""
    where = named_where(config)
    if not where:
        return exc
    sourced = copy.copy(exc)
    sourced.args = (f"{where}{exc}",) + exc.args[1:]
    return sourced


def resolve(
    config: Config, problem: Problem, registry: Registry, *, in_place: bool = False
) -> tuple[LoadedBackend, Any, Resolution]:
    """Pick the backend for ``problem``: returns the loaded backend, its options and the trace.
    An error about a backend name says where the name came from (the file, ``SSU_BACKEND``).
    ``in_place``: the caller steps an engine's cache and never calls ``kernel.sync`` (the drop-in
    call): a backend that keeps state beside the cache is rejected like one that does not serve
    the problem, so that ``"auto"`` and lists go on to one that does."""
    check_option_tables(config, registry)
    try:
        check_backend_names(config, registry)
    except BackendError as exc:
        raise _from_where(exc, config) from None
    requested = config.candidates
    trace: list[Candidate] = []
    order = auto_order(registry, trace) if requested == (AUTO,) else list(requested)
    for i, name in enumerate(order):
        try:
            loaded, options, notes = _evaluate(name, problem, config, registry, in_place)
        except BackendError as exc:
            if len(requested) == 1 and requested != (AUTO,):
                if isinstance(exc, BackendUnavailableError):  # the user's one name: say which would serve
                    exc = BackendUnavailableError(f"{exc}{_alternatives(name, problem, config, registry, in_place)}")
                raise _from_where(exc, config) from None
            trace.append(Candidate(name, "rejected", str(exc)))
            continue
        trace.append(Candidate(name, "selected", "; ".join(notes)))
        trace.extend(Candidate(rest, "not tried", f"{name} comes first") for rest in order[i + 1 :])
        return loaded, options, Resolution(requested, config.source, problem, name, tuple(trace))
    details = "\n".join(f"  - {c.name}: {c.reason}" for c in trace if c.outcome == "rejected")
    raise BackendUnavailableError(
        f"{named_where(config)}no backend of {', '.join(requested)} can serve this problem "
        f"({problem.describe()}):\n{details}",
        resolution=Resolution(requested, config.source, problem, None, tuple(trace)),
    )


def _alternatives(refused: str, problem: Problem, config: Config, registry: Registry, in_place: bool) -> str:
    """``; backends that serve this problem here: a, b`` (or nothing): the remedy of a refusal."""
    serving = []
    for name in sorted(registry.discover(), key=lambda n: (n == RESERVED, n)):
        if name == refused or registry.disabled_reason(name):
            continue
        try:
            _evaluate(name, problem, config, registry, in_place)
        except (BackendError, ConfigError):
            continue
        serving.append(name)
    return f"; backends that serve this problem here: {', '.join(serving)}" if serving else ""


def explain(config: Config, problem: Problem, registry: Registry) -> Resolution:
    """Like :func:`resolve` but never raises for backend reasons: the trace says it all, and it
    goes on to every other installed backend with its own verdict for the problem (``not
    requested``: whether it would serve it, and why not)."""
    try:
        resolution = resolve(config, problem, registry)[2]
    except BackendUnavailableError as exc:
        resolution = exc.resolution or Resolution(
            config.candidates,
            config.source,
            problem,
            None,
            (Candidate(", ".join(config.candidates), "rejected", str(exc)),),
        )
    except BackendError as exc:
        resolution = Resolution(
            config.candidates,
            config.source,
            problem,
            None,
            (Candidate(", ".join(config.candidates), "rejected", str(exc)),),
        )
    return with_other_verdicts(resolution, config, registry)


def with_other_verdicts(resolution: Resolution, config: Config, registry: Registry) -> Resolution:
    """``resolution`` with a ``not requested`` line for every installed backend it did not try:
    whether that backend would serve the problem, and why not (imports and probes them)."""
    problem = resolution.problem
    seen = {c.name for c in resolution.trace}
    others = []
    for name in sorted(registry.discover(), key=lambda n: (n == RESERVED, n)):
        if name in seen:
            continue
        reason = registry.disabled_reason(name)
        if reason is None:
            try:
                notes = _evaluate(name, problem, config, registry)[2]
            except (BackendError, ConfigError) as exc:
                reason = str(exc)
            else:
                reason = "; ".join(("would serve this problem",) + notes)
        others.append(Candidate(name, "not requested", reason))
    return attrs.evolve(resolution, trace=resolution.trace + tuple(others))
