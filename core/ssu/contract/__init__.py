"""The contract between the core and a backend: what both sides speak and agree on.

The problem, the records and errors both sides speak, the hook spec, the typed callables a backend
hands over (their protocols and the checks at open, importable from here), the option
records and the device check every backend starts with. Imports neither torch nor any GPU library.
"""

from __future__ import annotations

from .protocols import (
    ADDED_IN,
    ENGINE_CALL_PROTOCOLS,
    CacheLaneFn,
    CommitFn,
    LaneFn,
    PackedStepFn,
    StepFn,
    VerifyStepFn,
    check_engine_call,
    check_step,
    define_step,
    describe,
    expected_parameters,
)

__all__ = [
    "ADDED_IN",
    "ENGINE_CALL_PROTOCOLS",
    "CacheLaneFn",
    "CommitFn",
    "LaneFn",
    "PackedStepFn",
    "StepFn",
    "VerifyStepFn",
    "check_engine_call",
    "check_step",
    "define_step",
    "describe",
    "expected_parameters",
]
