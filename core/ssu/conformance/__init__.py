"""The conformance kit: the checks, cases and runner every backend is held to.

What ``ssu verify`` and ``pytest --ssu-backend`` hold every backend to (docs/writing-a-backend.md,
"What the conformance kit checks").

- :mod:`.cases`: the problems and call variants drawn inside a backend's capabilities, real model
  shapes, the profiles ``quick``, ``default`` and ``thorough``.
- :mod:`.checks`, :mod:`.id_checks`, :mod:`.engine_calls`: each check, against the float64 oracle
  within :func:`ssu.checking.oracle.tolerances`, on the comparisons of :mod:`.expect`; :mod:`.catalogue`:
  the table of them.
- :mod:`.rules`: the rules of docs/spec.md under the ids a failure names.
- :mod:`.runner`: the hypothesis loop that runs a check on a profile's cases and shrinks a failure.
"""

from __future__ import annotations

from ..checking.harness import CheckFailure
from .cases import LAYOUTS, PROFILES, REAL_SHAPES, Case, Profile
from .catalogue import CHECKS, Check, case_for, run_on
from .expect import CheckSkipped
from .runner import CheckReport, resolve_profile, run_check, run_conformance

#: the checks, in the order they run
CHECK_NAMES = list(CHECKS)

__all__ = [
    "CHECKS",
    "CHECK_NAMES",
    "LAYOUTS",
    "PROFILES",
    "REAL_SHAPES",
    "Case",
    "Check",
    "CheckFailure",
    "CheckReport",
    "CheckSkipped",
    "Profile",
    "case_for",
    "resolve_profile",
    "run_check",
    "run_conformance",
    "run_on",
]
