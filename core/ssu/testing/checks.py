"""The conformance checks as assertions, for pytest and a backend's own test files.

:func:`assert_conformant` runs the checks of :mod:`ssu.conformance` on the cases of a profile
(``smoke``, ``quick``, ``default``, ``thorough``) drawn inside the backend's capabilities, exactly as
``ssu verify`` does; a failure raises ``AssertionError`` naming the check, the backend and the
minimal case hypothesis shrank it to. The error budgets are docs/spec.md's ("Error budgets").
"""

from __future__ import annotations

from typing import Iterable, Optional

from .. import conformance
from ..conformance import CHECK_NAMES, CheckSkipped

__all__ = ["CHECK_NAMES", "BackendCannotRunHere", "CheckSkipped", "assert_conformant", "default_device"]


class BackendCannotRunHere(Exception):
    """The backend is unavailable on this machine (the pytest suite skips with the reason)."""


def default_device(capabilities) -> str:
    """CUDA when the backend declares it and a GPU is present, otherwise the CPU if declared, else its first device."""
    import torch

    if "cuda" in capabilities.devices and torch.cuda.is_available():
        return "cuda"
    return "cpu" if "cpu" in capabilities.devices else sorted(capabilities.devices)[0]


def assert_conformant(
    backend: str,
    *,
    checks: Optional[Iterable[str]] = None,
    profile: str = "default",
    max_examples: Optional[int] = None,
    device: Optional[str] = None,
    options: Optional[dict] = None,
    registry=None,
    state_dtypes: Optional[Iterable[str]] = None,
) -> None:
    """Run the conformance checks against installed (or registered) ``backend``; with
    ``state_dtypes``, on problems of those state dtypes only (each one the backend declares).

    Raises ``AssertionError`` on the first wrong result (after hypothesis shrinks it),
    :class:`BackendCannotRunHere` when the backend is unavailable here and :class:`CheckSkipped`
    when none of the chosen checks could run. ``max_examples`` overrides the profile's count.

    >>> assert_conformant("reference", checks=["roundtrip"], profile="quick")
    """
    from ..plugins.registry import default_registry

    registry = default_registry() if registry is None else registry
    loaded = registry.load(backend)
    capabilities = loaded.spec.capabilities
    device = device or default_device(capabilities)
    availability = loaded.probe(device)
    if not availability.available:
        raise BackendCannotRunHere(f"backend {backend!r} is unavailable on {device}: {availability.message()}")
    selected = list(checks or CHECK_NAMES)
    unknown = [c for c in selected if c not in conformance.CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; the checks are {', '.join(CHECK_NAMES)}")
    reports = conformance.run_conformance(
        backend,
        device=device,
        registry=registry,
        options=options,
        profile=profile,
        checks=selected,
        max_examples=max_examples,
        state_dtypes=state_dtypes,
    )
    for report in reports:
        if report.status == "fail":
            raise AssertionError(f"check {report.check!r} failed for backend {backend!r}: {report.failure}")
    if all(report.status == "skip" for report in reports):
        raise CheckSkipped("; ".join(f"{r.check}: {r.detail}" for r in reports))
