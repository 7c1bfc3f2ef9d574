"""The conformance checks over hypothesis-drawn problems within a backend's capabilities.

Each check (see :mod:`ssu.conformance` for what it asserts) runs on ``max_examples`` problems:
head shapes, groups, dtypes, cache size, batch, tokens per step and speculation, all drawn
inside what the backend declares. A failure raises ``AssertionError`` naming the check, the
problem and what was wrong; hypothesis then shrinks it to a small problem.

Tolerances: outputs and states must agree with the float64 oracle to within
``ssu.oracle.tolerance(state_dtype, input_dtype, T) = 4 x u x sqrt(T) + 1e-5``, where ``u`` is the
unit roundoff of the coarser of the state and input dtypes (at least 2^-20), measured as
``max |got - want| / max |want|``; ``write_state`` then ``read_state`` must round-trip exactly
(up to rounding to the cache dtype); slots outside the batch must stay bit-identical.
"""

from __future__ import annotations

from typing import Iterable, Optional

from .. import conformance
from ..harness import open_backend
from ..problem import Problem

CHECKS = conformance.CHECKS
CHECK_NAMES = list(CHECKS)


class BackendCannotRunHere(Exception):
    """The backend is unavailable on this machine (the pytest suite skips with the reason)."""


CheckSkipped = conformance.CheckSkipped


def problems(capabilities, device: str):
    """A hypothesis strategy of small problems inside ``capabilities`` on ``device``."""
    from hypothesis import strategies as st

    def sizes(allowed, default):
        return st.sampled_from(sorted(allowed)) if allowed is not None else st.sampled_from(default)

    @st.composite
    def draw_problem(draw):
        H = draw(sizes(capabilities.nheads, [2, 4, 6, 8]))
        groups = [g for g in range(1, H + 1) if H % g == 0 and g <= 4]
        if capabilities.ngroups is not None:
            groups = [g for g in groups if g in capabilities.ngroups] or sorted(capabilities.ngroups)[:1]
        G = draw(st.sampled_from(groups))
        max_tokens = min(4, capabilities.max_tokens_per_step) if capabilities.speculative else 1
        T = draw(st.integers(1, max_tokens))
        slots = draw(st.integers(2, 9))
        return Problem(
            nheads=H,
            ngroups=G,
            headdim=draw(sizes(capabilities.headdims, [1, 4, 5, 8, 16])),
            dstate=draw(sizes(capabilities.dstates, [1, 4, 12, 16])),
            state_dtype=draw(st.sampled_from(sorted(capabilities.state_dtypes))),
            input_dtype=draw(st.sampled_from(sorted(capabilities.input_dtypes))),
            num_slots=slots,
            max_batch=draw(st.integers(1, slots)),
            tokens_per_step=T,
            speculative=T > 1 or (capabilities.speculative and draw(st.booleans())),
            device=device,
        )

    return draw_problem()


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
    max_examples: int = 10,
    device: Optional[str] = None,
    options: Optional[dict] = None,
    registry=None,
) -> None:
    """Run the conformance checks against installed (or registered) ``backend``.

    Raises ``AssertionError`` on the first wrong result (after hypothesis shrinks it) and
    :class:`BackendCannotRunHere` when the backend is unavailable here.

    >>> assert_conformant("reference", checks=["roundtrip"], max_examples=2)
    """
    import torch
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from ..errors import SSUError
    from ..registry import default_registry

    registry = default_registry() if registry is None else registry
    loaded = registry.load(backend)
    capabilities = loaded.spec.capabilities
    device = device or default_device(capabilities)
    availability = loaded.probe(device)
    if not availability.available:
        raise BackendCannotRunHere(f"backend {backend!r} is unavailable on {device}: {availability.message()}")
    selected = list(checks or CHECK_NAMES)
    unknown = [c for c in selected if c not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; the checks are {', '.join(CHECK_NAMES)}")

    skipped: list = []
    ran: list = []

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        report_multiple_bugs=False,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(problem=problems(capabilities, device), seed=st.integers(0, 2**31 - 1))
    def run(problem, seed):
        try:
            kernel = open_backend(backend, problem, registry, options)
        except SSUError as exc:
            raise AssertionError(
                f"backend {backend!r} refused a problem inside its declared capabilities ({problem.describe()}): {exc}"
            ) from None
        for name in selected:
            try:
                CHECKS[name][0](kernel, torch.Generator().manual_seed(seed))
                ran.append(name)
            except conformance.CheckSkipped as exc:
                skipped.append(f"check {name!r}: {exc}")
            except conformance.CheckFailure as exc:
                raise AssertionError(
                    f"check {name!r} failed for backend {backend!r} on {problem.describe()}: {exc}"
                ) from None

    run()
    if skipped and not ran:  # not one drawn problem could run the checks
        raise CheckSkipped(skipped[0])
