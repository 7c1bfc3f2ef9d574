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
        raise ConfigError(
            f"Problem.state_dtype: {name} is not a state cache dtype; use one of {', '.join(STATE_DTYPES)}"
        )
    return name


def _input_dtype(value: Any) -> str:
    name = dtype_name(value, what="Problem.input_dtype")
    if name not in INPUT_DTYPES:
        raise ConfigError(f"Problem.input_dtype: {name} is not an input dtype; use one of {', '.join(INPUT_DTYPES)}")
    return name


def _integer(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"Problem.{attribute.name} must be an integer, got {value!r}")


def _boolean(instance, attribute, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"Problem.{attribute.name} must be true or false, got {value!r}")


@attrs.frozen(kw_only=True)
class Problem:
    """Everything a backend needs to know before the first step (docs/spec.md, "Shapes and names").

    Dtypes may be given as ``torch.dtype`` or names ("fp32", "bfloat16", ...); they are stored
    as short names so that problems are hashable and printable without torch.

    ``pad_slot_id`` marks padded rows: any integer. A negative one (the default -1) or one at or
    beyond ``num_slots`` names no slot; one inside ``[0, num_slots)`` reserves that slot as a null
    block (vLLM pads with block 0): it is never a sequence's state, and a backend may use it as a
    sink. ``engine_state``: the engine owns the cache tensor and the kernel adopts it
    (``kernel.adopt_state``); only backends that can step a foreign tensor in place serve it.
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
    speculative: bool = attrs.field(default=False, validator=_boolean)
    device: str = attrs.field(default="cpu", converter=str)
    pad_slot_id: int = attrs.field(default=-1, validator=_integer)
    engine_state: bool = attrs.field(default=False, validator=_boolean)

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
        if self.pad_in_cache and self.num_slots < 2:
            raise ConfigError(
                f"Problem: pad_slot_id={self.pad_slot_id} reserves the only slot of a cache of "
                f"num_slots={self.num_slots}; give more slots or a pad id outside the cache (-1)"
            )

    @property
    def device_type(self) -> str:
        """ "cpu", "cuda", ...: the device string without its index."""
        return self.device.split(":", 1)[0]

    @property
    def pad_in_cache(self) -> bool:
        """Whether the pad id names a slot of the cache (a reserved null block)."""
        return 0 <= self.pad_slot_id < self.num_slots

    @property
    def heads_per_group(self) -> int:
        """Heads that share one group's B and C (H / G)."""
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
        """A one-line description of the problem for messages and reports."""
        return (
            f"H={self.nheads} P={self.headdim} N={self.dstate} G={self.ngroups} "
            f"state={self.state_dtype} input={self.input_dtype} slots={self.num_slots} "
            f"max_batch={self.max_batch} T={self.tokens_per_step}"
            f"{' speculative' if self.speculative else ''} device={self.device}"
            f"{f' pad={self.pad_slot_id}' if self.pad_slot_id != -1 else ''}"
            f"{' engine-state' if self.engine_state else ''}"
        )
