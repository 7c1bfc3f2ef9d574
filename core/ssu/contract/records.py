"""Typed records exchanged between the core and backends (attrs, frozen).

A backend declares itself with a :class:`BackendSpec` (name, plugin API version, capabilities,
options class, description, url, factory). The core reports backends as :class:`BackendInfo` and
explains every decision with :class:`Verdict` / :class:`Availability` reasons.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import attrs

from .dtypes import FLOAT_STATE_DTYPES, INDEX_DTYPES, INPUT_DTYPES, STATE_DTYPES
from .problem import ENGINE_CALLS

if TYPE_CHECKING:  # records name these types; importing them here would import torch
    import torch

    from .problem import Problem

#: The plugin API this core implements. A backend declaring another major, or a newer minor,
#: is reported ``incompatible`` and never used. Hooks gain arguments in minor versions; none
#: are removed before the next major. 1.1 added ``Capabilities.layers_share_commit``; 1.2 added
#: adopted engine caches (``Capabilities.adopt_state``, hooks ``ssu_adopt_state`` and
#: ``ssu_sync_state``), destination slots (``Capabilities.destination_slots``, the step's
#: ``dst_slots``), pad ids inside the cache (``Capabilities.any_pad_slot_id``), guarded slot ids
#: (``Capabilities.guards_slots``, ``Context.faults``) and expanded per-head parameters
#: (``Capabilities.tied_inputs``); 1.3 added the layout and dtype limits a backend declares instead
#: of failing inside its kernel (``Capabilities.contiguous_rows``, ``Capabilities.dt_bias_as_dt``)
#: and the precision of its states (``Capabilities.state_precision``); 1.4 added the hook
#: ``ssu_traffic`` (the bytes a step moves, for the traffic floor ``ssu bench`` reports); 1.5
#: added quantised state dtypes (``int8``, ``fp8_e4m3``: served only where ``state_dtypes``
#: names them), their row scales (``State.scales``) and ``ssu_adopt_state``'s ``scales``; 1.6
#: added the step callable's optional ``lane`` (:class:`ssu.contract.LaneFn`); 1.7 its optional
#: ``cache_lane`` (:class:`ssu.contract.CacheLaneFn`), a lane taking the cache it steps; 1.8 the
#: engines' call forms (``Capabilities.engine_calls``, the hook ``ssu_engine_call``,
#: :class:`ssu.contract.PackedStepFn` and :class:`ssu.contract.VerifyStepFn`).
PLUGIN_API_VERSION = "1.8"
#: this distribution's version (ssu-core): ``ssu.__version__``
CORE_VERSION = "0.1.0"


def _frozen(values) -> frozenset:
    return frozenset(values)


def _optional_frozen(values) -> Optional[frozenset]:
    return None if values is None else frozenset(values)


def _engine_calls(instance, attribute, value) -> None:
    unknown = sorted(set(value) - set(ENGINE_CALLS))
    if unknown:
        raise ValueError(f"{attribute.name}: unknown engine call form(s) {unknown}; known: {', '.join(ENGINE_CALLS)}")


def _optional_state_dtype(instance, attribute, value) -> None:
    if value is not None and value not in STATE_DTYPES:
        raise ValueError(f"Capabilities.{attribute.name} must be None or one of {sorted(STATE_DTYPES)}, got {value!r}")


@attrs.frozen
class Capabilities:
    """What a backend can do. The core refuses problems outside these before calling the backend.

    ``headdims``/``dstates``/``nheads``/``ngroups`` are ``None`` for "any value".

    ``layers_share_commit``: the layers of one :class:`State` share a single commit (ReplaySSM's
    ring cursors). Between two commits every layer of the group is stepped once with the same
    slots; without speculation the group commits at the step of its last layer, or at an
    explicit ``commit`` (with ``num_accepted`` of ones) if the backend's options say so.

    ``adopt_state``: ``kernel.adopt_state(cache)`` steps an engine's own cache tensor in place.
    ``destination_slots``: the step takes ``dst_slots`` (read ``slots[b]``, write ``dst_slots[b]``).
    ``any_pad_slot_id``: the pad id may be any integer, a slot of the cache included (a reserved
    null block); without it only negative pad ids are served.
    ``guards_slots``: the step and commit treat slot ids outside the cache (and accepted counts
    outside 1..T) as pad rows and record them in ``Context.faults``; without it the core guards
    the ids and counts itself before each validated step and commit (its commit then sees only
    real slots with counts in 1..T, and pad rows, which it passes over).
    ``tied_inputs``: the step also takes the per-head parameters in Mamba2's expanded form, as
    engines pass them: dt (b, [T,] H, P), A (H, P, N), D and dt_bias (H, P), each with stride 0
    along P (and N), so that no view has to be made per call.
    ``contiguous_rows``: the step reads each row of x, z, B, C, dt and out contiguously and the
    per-head A, D and dt_bias with unit stride over the heads; only the batch and token strides
    are free (a slice of a projection is fine, a transposed view is not). The core refuses other
    layouts; without it any strides a view produces are served.
    ``dt_bias_as_dt``: the kernel reads dt_bias in dt's dtype, so one wider than dt (fp32 with a
    bf16 or fp16 dt) is refused rather than rounded (rounding it would move every state).
    ``state_precision``: the dtype whose rounding bounds the error of the states this backend
    computes, where that is coarser than the state dtype (a kernel whose products run on bf16
    tensor cores declares ``"bf16"``); the conformance kit's state budget follows it, and users
    see it in ``ssu list``. None: the state dtype's own rounding.
    ``engine_calls``: the engines' call forms the backend serves (:data:`ENGINE_CALLS`: ``packed``,
    ``verify``, ``tree``), each through the callable its ``ssu_engine_call`` hook returns; the
    backend guards their ids and counts itself, so declaring any needs ``guards_slots``.
    """

    devices: frozenset = attrs.field(default=("cpu", "cuda"), converter=_frozen)
    state_dtypes: frozenset = attrs.field(default=FLOAT_STATE_DTYPES, converter=_frozen)
    input_dtypes: frozenset = attrs.field(default=INPUT_DTYPES, converter=_frozen)
    index_dtypes: frozenset = attrs.field(default=INDEX_DTYPES, converter=_frozen)
    max_tokens_per_step: int = 1
    speculative: bool = False
    headdims: Optional[frozenset] = attrs.field(default=None, converter=_optional_frozen)
    dstates: Optional[frozenset] = attrs.field(default=None, converter=_optional_frozen)
    nheads: Optional[frozenset] = attrs.field(default=None, converter=_optional_frozen)
    ngroups: Optional[frozenset] = attrs.field(default=None, converter=_optional_frozen)
    stochastic_rounding: bool = False
    cuda_graphs: bool = False
    torch_compile: bool = False
    layers_share_commit: bool = False
    adopt_state: bool = False
    destination_slots: bool = False
    any_pad_slot_id: bool = False
    guards_slots: bool = False
    tied_inputs: bool = False
    contiguous_rows: bool = False
    dt_bias_as_dt: bool = False
    state_precision: Optional[str] = attrs.field(default=None, validator=_optional_state_dtype)
    engine_calls: frozenset = attrs.field(default=(), converter=_frozen, validator=_engine_calls)

    def __attrs_post_init__(self) -> None:
        if self.engine_calls and not self.guards_slots:
            raise ValueError(
                "Capabilities.engine_calls needs guards_slots=True: the engine call forms' slot tables, counts and "
                "offsets are guarded by the backend (the core guards only the step's and the commit's)"
            )
        if "tree" in self.engine_calls and "verify" not in self.engine_calls:
            raise ValueError("Capabilities.engine_calls: 'tree' (verify calls with parent tokens) needs 'verify' too")

    def check(self, problem: "Problem") -> list[str]:
        """Reasons why ``problem`` is outside these capabilities (empty list: inside)."""
        reasons: list[str] = []
        if problem.device_type not in self.devices:
            reasons.append(f"device {problem.device_type!r} not supported (supports {_names(self.devices)})")
        if problem.state_dtype not in self.state_dtypes:
            reasons.append(f"state dtype {problem.state_dtype} not supported (supports {_names(self.state_dtypes)})")
        if problem.input_dtype not in self.input_dtypes:
            reasons.append(f"input dtype {problem.input_dtype} not supported (supports {_names(self.input_dtypes)})")
        if problem.speculative and not self.speculative:
            reasons.append("speculative decoding (step then commit) not supported")
        if problem.tokens_per_step > self.max_tokens_per_step:
            reasons.append(f"tokens_per_step={problem.tokens_per_step} exceeds the maximum {self.max_tokens_per_step}")
        for field, allowed in (
            ("headdim", self.headdims),
            ("dstate", self.dstates),
            ("nheads", self.nheads),
            ("ngroups", self.ngroups),
        ):
            value = getattr(problem, field)
            if allowed is not None and value not in allowed:
                reasons.append(f"{field}={value} not supported (supports {_names(allowed)})")
        if problem.engine_state and not self.adopt_state:
            reasons.append(
                "stepping an engine's own cache in place (Problem.engine_state) not supported: it "
                "allocates its own state; hand states over with write_state / read_state"
            )
        for form in sorted(problem.engine_calls - self.engine_calls):
            reasons.append(f"engine call {form!r} ({ENGINE_CALLS[form]}) not supported")
        if problem.pad_slot_id >= 0 and not self.any_pad_slot_id:
            reasons.append(
                f"pad_slot_id={problem.pad_slot_id} names a slot of the cache; this backend serves "
                "negative pad ids only (use pad_slot_id=-1)"
            )
        return reasons

    def to_dict(self) -> dict:
        """JSON-friendly form (sets become sorted lists)."""
        return {k: (sorted(v) if isinstance(v, frozenset) else v) for k, v in attrs.asdict(self).items()}


def _names(values) -> str:
    return ", ".join(str(v) for v in sorted(values, key=str))


@attrs.frozen
class Availability:
    """Whether a backend can run on this machine at all; when not, why and how to fix it."""

    available: bool
    reason: str = ""
    remedy: str = ""

    def message(self) -> str:
        """The reason, followed by the remedy when there is one."""
        return self.reason + (f"; {self.remedy}" if self.remedy else "")


AVAILABLE = Availability(True)


@attrs.frozen
class Verdict:
    """Whether a backend supports one problem: accepted, or rejected with every reason. An
    accepting verdict's ``reasons`` are notes about how it will serve the problem (memory it adds,
    a precision), which ``ssu explain`` prints beside the selected backend."""

    ok: bool
    reasons: tuple = attrs.field(default=(), converter=tuple)

    @classmethod
    def reject(cls, *reasons: str) -> "Verdict":
        """A refusal with one or more reasons, each a sentence a user can act on."""
        return cls(False, reasons)

    @classmethod
    def accept(cls, *notes: str) -> "Verdict":
        """An acceptance, with notes for ``ssu explain`` (none: :data:`ACCEPT`)."""
        return cls(True, notes)


ACCEPT = Verdict(True)


@attrs.frozen
class BackendSpec:
    """A backend's declaration, returned by its ``ssu_backend`` hook.

    ``factory(ctx)`` returns the step callable (the hot path) for one opened kernel;
    ``options_class`` is an attrs class validating ``[ssu.backends.<name>]``; ``priority``
    orders backends under ``backend = "auto"`` (higher first; ``reference`` is always last).
    """

    name: str
    api_version: str
    factory: Callable[..., Callable]
    capabilities: Capabilities = attrs.field(factory=Capabilities)
    options_class: Optional[type] = None
    description: str = ""
    url: str = ""
    priority: int = 0


@attrs.frozen
class BackendInfo:
    """One discovered backend as ``ssu.list_backends()`` reports it.

    ``status`` is ``installed`` (found, not imported yet), ``disabled`` (filtered by
    ``SSU_PLUGINS``/``SSU_DISABLE_PLUGINS`` before import), or, once probed, ``available``,
    ``unavailable``, ``broken`` or ``incompatible``; ``reason`` says why for the last four.
    """

    name: str
    distribution: str
    version: str
    module: str
    status: str
    reason: str = ""
    description: str = ""
    capabilities: Optional[Capabilities] = None

    def to_dict(self) -> dict:
        """The record as JSON-ready values (what ``ssu backends --json`` prints)."""
        data = attrs.asdict(self, recurse=False)
        data["capabilities"] = self.capabilities.to_dict() if self.capabilities else None
        return data


@attrs.define(eq=False)
class Context:
    """What a backend knows about one opened kernel; passed to every lifecycle hook.

    ``options`` is the backend's validated options instance (or ``None`` without an options
    class); ``scratch`` is what ``ssu_allocate_scratch`` returned; ``memo`` is free for the
    backend's own per-kernel data (compiled modules, tuned launch parameters). ``faults`` is the
    kernel's device-side record of guarded ids (see :mod:`ssu.state.faults`): a backend that declares
    ``guards_slots`` lowers it with the key of each row it refused.
    """

    problem: "Problem"
    options: Any
    spec: BackendSpec
    scratch: Any = None
    memo: dict = attrs.field(factory=dict)
    faults: Optional["torch.Tensor"] = None


@attrs.define(eq=False)
class State:
    """The recurrent state of a group of layers, in a layout its backend owns, or an engine's
    cache tensors adopted in place.

    ``buffers`` holds the backend's tensors by name, each indexed by layer then slot (or by slot
    alone, when 1-D); the core never interprets them. ``cache`` holds, for an adopted state, the
    engine's tensor of each layer, ``(num_slots, H, P, N)``: steps read and write it in place.
    The logical state is read and written only through the kernel's ``read_state`` /
    ``write_state``. ``backend`` and ``problem`` let the core refuse a state handed to the wrong
    kernel. ``views`` (per-layer tensors the step indexes), ``scales`` (for a quantised state, the
    same per layer for its fp32 row scales: :mod:`ssu.state.quant`) and ``record`` (host-side facts the
    device buffers do not hold) are the backend's own; ``stepped`` and ``checked`` are the core's:
    the layers stepped since the last commit, and which kernels' checks the state passed, kept
    while validation is on.
    """

    backend: str
    problem: "Problem"
    num_layers: int
    buffers: dict = attrs.field(repr=lambda b: "{" + ", ".join(b) + "}")
    cache: tuple = attrs.field(default=(), converter=tuple, repr=lambda c: f"<{len(c)} engine tensor(s)>")
    views: tuple = attrs.field(default=(), converter=tuple, repr=False)
    scales: tuple = attrs.field(default=(), converter=tuple, repr=False)
    record: Any = attrs.field(default=None, repr=False)
    stepped: set = attrs.field(factory=set, repr=False)
    checked: set = attrs.field(factory=set, repr=False)

    @property
    def adopted(self) -> bool:
        """Whether the logical state lives in an engine's tensors (``cache``)."""
        return bool(self.cache)

    @property
    def nbytes(self) -> int:
        """Device bytes held by the backend's buffers (an adopted engine cache not counted)."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())
