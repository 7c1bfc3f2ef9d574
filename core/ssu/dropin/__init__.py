"""The drop-in call: ``ssu.selective_state_update``, as model code and engines call it.

mamba_ssm's signature (:mod:`.mamba`) and the engines' speculative call forms with their own
argument names (:mod:`.engines`), served by kernels opened per problem on the caller's adopted
cache (:mod:`.cache`).
"""

from __future__ import annotations

from typing import Any

from .cache import LANE_BINDS, after_cache_lanes, clear, kernel_for, lanes_of, on_open, served
from .engines import SGLANG_ARGUMENTS, VLLM_ARGUMENTS, call_form, engine_call
from .mamba import selective_state_update

__all__ = [
    "LANE_BINDS",
    "SGLANG_ARGUMENTS",
    "VLLM_ARGUMENTS",
    "after_cache_lanes",
    "call_form",
    "clear",
    "engine_call",
    "kernel_for",
    "lanes_of",
    "on_open",
    "selective_state_update",
    "served",
]


def __getattr__(name: str) -> Any:  # pragma: no cover - helpful error for a common typo
    raise AttributeError(f"module 'ssu.dropin' has no attribute {name!r}; the call is ssu.selective_state_update")
