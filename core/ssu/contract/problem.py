"""The problem a kernel is opened for: head shapes, dtypes, cache size, batch bound, tokens."""

from __future__ import annotations

from typing import Any, Optional

import attrs

from .dtypes import INPUT_DTYPES, STATE_DTYPES, dtype_in
from .errors import ConfigError

#: the engines' call forms a backend may serve (docs/spec.md, "Engine call forms"), and what each is
ENGINE_CALLS = {
    "packed": "vLLM's speculative call: tokens packed by cu_seqlens, per-token slot tables, num_accepted_tokens",
    "verify": "SGLang's verify call: T tokens a row, an intermediate-state buffer, the cache written or not",
    "tree": "SGLang's verify call with parent tokens (EAGLE trees): a token continues from its parent's state",
}


def _positive(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"Problem.{attribute.name} must be a positive integer, got {value!r}")


def _state_dtype(value: Any) -> str:
    return dtype_in(value, STATE_DTYPES, what="Problem.state_dtype", kind="a state cache dtype")


def _input_dtype(value: Any) -> str:
    return dtype_in(value, INPUT_DTYPES, what="Problem.input_dtype", kind="an input dtype")


def _integer(instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"Problem.{attribute.name} must be an integer, got {value!r}")


def _engine_calls(value: Any) -> frozenset:
    if isinstance(value, str):
        value = (value,)
    try:
        forms = frozenset(value)
    except TypeError:
        raise ConfigError(f"Problem.engine_calls: expected a set of call form names, got {value!r}") from None
    unknown = sorted(f for f in forms if f not in ENGINE_CALLS)
    if unknown:
        raise ConfigError(
            f"Problem.engine_calls: unknown call form(s) {unknown}; the forms are "
            + "; ".join(f"{k!r}: {v}" for k, v in ENGINE_CALLS.items())
        )
    return forms | {"verify"} if "tree" in forms else forms


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

    ``engine_calls``: the engines' call forms the kernel serves beside its step (docs/spec.md,
    "Engine call forms"): ``"packed"`` (vLLM's, ``kernel.packed_step``), ``"verify"`` (SGLang's,
    ``kernel.verify_step``), ``"tree"`` (verify calls with parent tokens; implies ``"verify"``).
    ``tokens_per_step`` then bounds their tokens per sequence; without ``speculative`` the step
    itself still takes one token.
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
    engine_calls: frozenset = attrs.field(default=frozenset(), converter=_engine_calls)

    def __attrs_post_init__(self) -> None:
        if self.nheads % self.ngroups:
            raise ConfigError(
                f"Problem: nheads={self.nheads} is not a multiple of ngroups={self.ngroups}; "
                "each group must serve the same number of heads"
            )
        if not self.speculative and not self.engine_calls and self.tokens_per_step != 1:
            raise ConfigError(
                f"Problem: tokens_per_step={self.tokens_per_step} needs speculative=True "
                "(without speculation every token commits at once, so a step carries one token), "
                "or engine_calls for the engines' speculative call forms"
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

    @property
    def quantized(self) -> bool:
        """Whether the state cache holds 8-bit values with one fp32 scale per (slot, head, row)."""
        from .dtypes import QUANTIZED_STATE_DTYPES

        return self.state_dtype in QUANTIZED_STATE_DTYPES

    def state_bytes_per_slot(self) -> int:
        """Bytes of one slot's recurrent state in the cache dtype (its scales included)."""
        from .dtypes import state_slot_bytes

        return state_slot_bytes(self.nheads, self.headdim, self.dstate, self.state_dtype)

    def shard(self, tp: int, rank: int, *, device: Optional[str] = None) -> "Problem":
        """The problem one rank of a ``tp``-way tensor-parallel layer holds: H / tp heads and
        G / tp groups, on ``device`` (default: this problem's; pass the rank's own, ``cuda:1``).

        A single group (G = 1, Granite 4.0-H, Mamba2-2.7B) is replicated: every rank holds it
        whole, as Mamba2 engines shard such layers. Refused with ``ConfigError`` when H is not a
        multiple of tp, or G > 1 is not; :meth:`shard_slices` says which heads and groups a rank
        takes from the unsharded tensors."""
        heads, groups = self.shard_slices(tp, rank)
        return attrs.evolve(
            self, nheads=len(heads), ngroups=len(groups), device=self.device if device is None else device
        )

    def shard_slices(self, tp: int, rank: int) -> tuple[range, range]:
        """(heads, groups) of the unsharded layer that rank ``rank`` of ``tp`` holds (see :meth:`shard`)."""
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(f"shard: tp must be a positive integer, got {tp!r}")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp:
            raise ConfigError(f"shard: rank must be 0..{tp - 1} for tp={tp}, got {rank!r}")
        H, G = self.nheads, self.ngroups
        if H % tp:
            fits = [d for d in range(1, H + 1) if H % d == 0 and (G == 1 or G % d == 0)]
            raise ConfigError(
                f"shard: nheads={H} does not split over tp={tp} ranks; tensor parallelism needs H a "
                f"multiple of tp (tp that fit H={H} G={G}: {', '.join(map(str, fits))})"
            )
        if G % tp and G != 1:
            fits = [d for d in range(1, G + 1) if G % d == 0 and H % d == 0]
            raise ConfigError(
                f"shard: ngroups={G} does not split over tp={tp} ranks (a single group is replicated, "
                f"{G} groups are not); tp that fit H={H} G={G}: {', '.join(map(str, fits))}"
            )
        h = H // tp
        heads = range(rank * h, (rank + 1) * h)
        if G == 1:
            return heads, range(0, 1)
        g = G // tp
        return heads, range(rank * g, (rank + 1) * g)

    def describe(self) -> str:
        """A one-line description of the problem for messages and reports."""
        return (
            f"H={self.nheads} P={self.headdim} N={self.dstate} G={self.ngroups} "
            f"state={self.state_dtype} input={self.input_dtype} slots={self.num_slots} "
            f"max_batch={self.max_batch} T={self.tokens_per_step}"
            f"{' speculative' if self.speculative else ''} device={self.device}"
            f"{f' pad={self.pad_slot_id}' if self.pad_slot_id != -1 else ''}"
            f"{' engine-state' if self.engine_state else ''}"
            f"{' calls=' + ','.join(sorted(self.engine_calls)) if self.engine_calls else ''}"
        )
