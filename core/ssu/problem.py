"""The problem a kernel is opened for: head shapes, dtypes, cache size, batch bound, tokens."""

from __future__ import annotations

from typing import Any

import attrs

from .dtypes import INPUT_DTYPES, STATE_DTYPES, dtype_name
from .errors import ConfigError


def _positive(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"Problem.{attribute.name} must be a positive integer, got {value!r}")


def _state_dtype(value: Any) -> str:
    name = dtype_name(value, what="Problem.state_dtype")
    if name not in STATE_DTYPES:
        raise ConfigError(f"Problem.state_dtype: {name} is not a state cache dtype; use one of {', '.join(STATE_DTYPES)}")
    return name


def _input_dtype(value: Any) -> str:
    name = dtype_name(value, what="Problem.input_dtype")
    if name not in INPUT_DTYPES:
        raise ConfigError(f"Problem.input_dtype: {name} is not an input dtype; use one of {', '.join(INPUT_DTYPES)}")
    return name


@attrs.frozen(kw_only=True)
class Problem:
    """Everything a backend needs to know before the first step (SPEC.md, "Shapes and names").

    Dtypes may be given as ``torch.dtype`` or names ("fp32", "bfloat16", ...); they are stored
    as short names so that problems are hashable and printable without torch.

    >>> Problem(nheads=128, headdim=64, dstate=128, ngroups=8, state_dtype="fp32",
    ...         input_dtype="bf16", num_slots=64, max_batch=16).tokens_per_step
    1
    """

    nheads: int = attrs.field(validator=_positive)
    headdim: int = attrs.field(validator=_positive)
    dstate: int = attrs.field(validator=_positive)
    ngroups: int = attrs.field(default=1, validator=_positive)
    state_dtype: str = attrs.field(default="fp32", converter=_state_dtype)
    input_dtype: str = attrs.field(default="bf16", converter=_input_dtype)
    num_slots: int = attrs.field(default=1, validator=_positive)
    max_batch: int = attrs.field(default=1, validator=_positive)
    tokens_per_step: int = attrs.field(default=1, validator=_positive)
    speculative: bool = False
    device: str = attrs.field(default="cpu", converter=str)
    pad_slot_id: int = -1

    def __attrs_post_init__(self) -> None:
        if self.nheads % self.ngroups:
            raise ConfigError(
                f"Problem: nheads={self.nheads} is not a multiple of ngroups={self.ngroups}; "
                "each group must serve the same number of heads"
            )
        if not self.speculative and self.tokens_per_step != 1:
            raise ConfigError(
                f"Problem: tokens_per_step={self.tokens_per_step} needs speculative=True "
                "(without speculation every token commits at once, so a step carries one token)"
            )
        if not isinstance(self.speculative, bool):
            raise ConfigError(f"Problem.speculative must be true or false, got {self.speculative!r}")
        if isinstance(self.pad_slot_id, bool) or not isinstance(self.pad_slot_id, int) or self.pad_slot_id >= 0:
            raise ConfigError(
                f"Problem.pad_slot_id must be a negative integer (it may never name a real slot), got {self.pad_slot_id!r}"
            )

    @property
    def device_type(self) -> str:
        """"cpu", "cuda", ...: the device string without its index."""
        return self.device.split(":", 1)[0]

    @property
    def heads_per_group(self) -> int:
        return self.nheads // self.ngroups

    @property
    def multi_token(self) -> bool:
        """Whether inputs carry a token axis: x is (b, T, H, P) rather than (b, H, P)."""
        return self.speculative

    def state_bytes_per_slot(self) -> int:
        """Bytes of one slot's recurrent state in the cache dtype."""
        from .dtypes import ITEMSIZE

        return self.nheads * self.headdim * self.dstate * ITEMSIZE[self.state_dtype]

    def describe(self) -> str:
        return (
            f"H={self.nheads} P={self.headdim} N={self.dstate} G={self.ngroups} "
            f"state={self.state_dtype} input={self.input_dtype} slots={self.num_slots} "
            f"max_batch={self.max_batch} T={self.tokens_per_step}"
            f"{' speculative' if self.speculative else ''} device={self.device}"
        )
