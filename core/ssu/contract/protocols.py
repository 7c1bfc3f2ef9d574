"""The calls a backend implements, in one place: the step callable and the commit, as typed
protocols, and the check that a backend's step has the contract's signature.

Every spelling of the step's arguments elsewhere (the kernel's checking wrapper, each backend's
step) is checked against :class:`StepFn` when a kernel opens, so an argument added here and
forgotten in a backend is reported at once, naming the backend and what differs.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Callable, Optional, Protocol

from .errors import BackendError

if TYPE_CHECKING:
    from torch import Tensor

    from .records import State


class StepFn(Protocol):
    """One SSU step of ``layer`` for a batch (docs/spec.md): returns ``out``.

    ``x`` (b, H, P), or (b, T, H, P) for a speculative kernel; ``dt`` (b, [T,] H); ``A`` (H,)
    fp32; ``B``, ``C`` (b, [T,] G, N); ``slots`` (b,) int32/int64, the slot each row reads (and
    writes, unless ``dst_slots`` names another); ``D``, ``dt_bias`` (H,) and ``z`` (like x)
    optional; ``out`` like x (allocated if None). No hook dispatch, no host synchronisation.
    """

    def __call__(
        self,
        state: "State",
        x: "Tensor",
        dt: "Tensor",
        A: "Tensor",
        B: "Tensor",
        C: "Tensor",
        slots: "Tensor",
        D: Optional["Tensor"] = None,
        z: Optional["Tensor"] = None,
        dt_bias: Optional["Tensor"] = None,
        dt_softplus: bool = False,
        out: Optional["Tensor"] = None,
        layer: int = 0,
        dst_slots: Optional["Tensor"] = None,
    ) -> "Tensor": ...


class LaneFn(Protocol):
    """Later one-token steps of one layout, launched with less host work (plugin API 1.6,
    optional): what a step callable's ``lane`` attribute returns, ``step.lane(state, layer, x, dt,
    A, B, C, slots, D, z, dt_bias, dt_softplus)``, for calls with that call's state, layer and
    slots and the same sizes, strides, dtypes and devices of the other tensors (None where the
    backend has no faster path for it). Called with what changes between decode steps, it does
    what ``step(state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, None, layer)`` does and
    returns the output it allocated, or returns None, having done nothing, for a call it declines
    (another layout, another current device, an address it cannot take): the caller then calls
    the step. An eager decode at small batch pays an SSU call's host time, not its kernel's."""

    def __call__(
        self,
        x: "Tensor",
        dt: "Tensor",
        A: "Tensor",
        B: "Tensor",
        C: "Tensor",
        D: Optional["Tensor"],
        z: Optional["Tensor"],
        dt_bias: Optional["Tensor"],
        dt_softplus: bool,
    ) -> Optional["Tensor"]: ...


class CacheLaneFn(Protocol):
    """A lane that takes the cache it steps (plugin API 1.7, optional): what a step callable's
    ``cache_lane`` attribute returns, ``step.cache_lane(state, layer, x, dt, A, B, C, slots, D, z,
    dt_bias, dt_softplus)``, for an adopted one-token ``state``. Called as :class:`LaneFn` is, with
    the tensor to step first: the adopted tensor of ``layer``, or any other tensor of its sizes,
    strides, dtype and device (a copy an engine makes of its cache before each step, say), which it
    steps in place as it would the adopted one. It keeps no reference to any of them, so a copy the
    engine drops is freed. It declines (returns None, having done nothing) what a :class:`LaneFn`
    declines, and a tensor of another layout."""

    def __call__(
        self,
        cache: "Tensor",
        x: "Tensor",
        dt: "Tensor",
        A: "Tensor",
        B: "Tensor",
        C: "Tensor",
        D: Optional["Tensor"],
        z: Optional["Tensor"],
        dt_bias: Optional["Tensor"],
        dt_softplus: bool,
    ) -> Optional["Tensor"]: ...


class PackedStepFn(Protocol):
    """vLLM's speculative call (Problem.engine_calls ``"packed"``; docs/spec.md, "Engine call
    forms"): the tokens of N sequences packed along the first dimension, per-token slots, no commit.

    ``x`` (tokens, H, P); ``dt`` (tokens, H); ``B``, ``C`` (tokens, G, N); ``z``, ``out`` like x.
    ``cu_seqlens`` (N + 1,): sequence n owns rows ``cu_seqlens[n]`` to ``cu_seqlens[n + 1] - 1``
    (None: row n, one token each). ``slots`` (N, W): sequence n starts from the state of slot
    ``slots[n, max(num_accepted[n] - 1, 0)]`` (column 0 when ``num_accepted`` is None);
    ``dst_slots`` (N, W), default ``slots``: the state after its token t goes to slot
    ``dst_slots[n, t]``, none where that cell is the pad id. Returns ``out``. No hook dispatch, no
    host synchronisation.
    """

    def __call__(
        self,
        state: "State",
        x: "Tensor",
        dt: "Tensor",
        A: "Tensor",
        B: "Tensor",
        C: "Tensor",
        slots: "Tensor",
        dst_slots: Optional["Tensor"] = None,
        num_accepted: Optional["Tensor"] = None,
        cu_seqlens: Optional["Tensor"] = None,
        D: Optional["Tensor"] = None,
        z: Optional["Tensor"] = None,
        dt_bias: Optional["Tensor"] = None,
        dt_softplus: bool = False,
        out: Optional["Tensor"] = None,
        layer: int = 0,
    ) -> "Tensor": ...


class VerifyStepFn(Protocol):
    """SGLang's verify call (Problem.engine_calls ``"verify"``, with ``parents`` ``"tree"``;
    docs/spec.md, "Engine call forms"): T tokens per row, the state after each stored in an
    intermediate-state buffer, the cache written or not.

    ``x`` (b, T, H, P); ``dt`` (b, T, H); ``B``, ``C`` (b, T, G, N); ``slots`` (b,): the slot each
    row starts from and, with ``update_state``, where the state after its last token goes.
    ``buffer`` (rows, steps, H, P, N), steps >= T: the state after token t of row b is stored at
    ``buffer[buffer_rows[b], t]`` (``buffer_rows`` default: ``slots``). ``parents`` (b, T): token t
    >= 1 continues from the state after token ``parents[b, t]`` when that is one of 0..t-1 (the
    one before it when negative). Returns ``out``. No hook dispatch, no host synchronisation.
    """

    def __call__(
        self,
        state: "State",
        x: "Tensor",
        dt: "Tensor",
        A: "Tensor",
        B: "Tensor",
        C: "Tensor",
        slots: "Tensor",
        D: Optional["Tensor"] = None,
        z: Optional["Tensor"] = None,
        dt_bias: Optional["Tensor"] = None,
        dt_softplus: bool = False,
        out: Optional["Tensor"] = None,
        layer: int = 0,
        update_state: bool = True,
        buffer: Optional["Tensor"] = None,
        buffer_rows: Optional["Tensor"] = None,
        parents: Optional["Tensor"] = None,
    ) -> "Tensor": ...


class CommitFn(Protocol):
    """Speculative decoding: keep each sequence's first ``num_accepted[b]`` tokens of the last step."""

    def __call__(self, state: "State", slots: "Tensor", num_accepted: "Tensor") -> None: ...


def _parameters(fn: Callable) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]


#: the step's parameters, in order, with their defaults
STEP_PARAMETERS: tuple[inspect.Parameter, ...] = tuple(_parameters(StepFn.__call__))
STEP_NAMES: tuple[str, ...] = tuple(p.name for p in STEP_PARAMETERS)
#: the parameters that are tensors (all but the state, the softplus flag and the layer), in order
TENSOR_NAMES: tuple[str, ...] = tuple(n for n in STEP_NAMES if n not in ("state", "dt_softplus", "layer"))
#: the tensor parameters that may be None
OPTIONAL_TENSORS: frozenset = frozenset(p.name for p in STEP_PARAMETERS if p.name in TENSOR_NAMES and p.default is None)
#: the per-head parameters, which may come expanded over P and N (``Capabilities.tied_inputs``)
PER_HEAD: tuple[str, ...] = ("dt", "A", "D", "dt_bias")
#: parameters added by plugin API minors: a backend declaring an older minor may omit them
ADDED_IN = {"dst_slots": (1, 2)}
#: each engine call form's protocol (``Capabilities.engine_calls``; ``"tree"`` calls are verify calls)
ENGINE_CALL_PROTOCOLS = {"packed": PackedStepFn, "verify": VerifyStepFn}
#: each engine call form's parameters, in order, with their defaults
ENGINE_CALL_PARAMETERS: dict = {form: tuple(_parameters(fn.__call__)) for form, fn in ENGINE_CALL_PROTOCOLS.items()}


def describe(parameters) -> str:
    """``(state, x, ..., dst_slots=None)``."""
    return (
        "("
        + ", ".join(p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}" for p in parameters)
        + ")"
    )


def define_step(body: str, passed: tuple, namespace: dict, name: str) -> "StepFn":
    """A function with the step's signature (``StepFn``'s parameters and defaults), running
    ``body`` (source, indented four spaces, which may use every parameter by name and the names in
    ``namespace``) and then returning ``raw(...)`` with the parameters ``passed``: how the core
    wraps a backend's step without spelling the signature out again."""
    source = f"def step{describe(STEP_PARAMETERS)}:\n{body}    return raw({', '.join(passed)})\n"
    scope = dict(namespace)
    exec(compile(source, f"<{name}>", "exec"), scope)  # noqa: S102 - source built from the contract's names
    return scope["step"]


def expected_parameters(api: tuple[int, int]) -> tuple[inspect.Parameter, ...]:
    """The step's parameters for a backend declaring plugin API ``api``."""
    return tuple(p for p in STEP_PARAMETERS if ADDED_IN.get(p.name, (0, 0)) <= api)


def _mismatch(fn: Callable, want: tuple) -> Optional[tuple]:
    """None when ``fn`` takes ``want``'s parameters in order with the same defaults (or is a pure
    forwarder, ``(*args, **kwargs)``, or has no signature to compare); else its parameters."""
    try:
        got = _parameters(fn)
    except (TypeError, ValueError):  # a builtin or C callable without a signature: nothing to compare
        return None
    if [p.kind for p in got] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        return None  # a forwarder, (*args, **kwargs): what it forwards to is not ours to see
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    same = len(got) == len(want) and all(
        g.name == w.name and g.default == w.default and g.kind in kinds for g, w in zip(got, want)
    )
    return None if same else tuple(got)


def check_step(fn: Callable, backend: str, api_version: str) -> None:
    """Raise :class:`~ssu.BackendError` unless ``fn`` takes the contract's parameters, in order and
    with the same defaults, for the backend's plugin API (compared with :func:`inspect.signature`).
    A pure forwarder, ``(*args, **kwargs)``, passes."""
    api = tuple(int(p) for p in str(api_version).split(".")[:2])
    want = expected_parameters(api)
    got = _mismatch(fn, want)
    if got is not None:
        raise BackendError(
            f"backend {backend!r}: its step callable takes {describe(got)}; plugin API {api_version} needs "
            f"{describe(want)} (the order and defaults of ssu.contract.StepFn). Fix the factory's step function"
        )


def check_engine_call(fn: Callable, backend: str, form: str) -> None:
    """Raise :class:`~ssu.BackendError` unless ``fn``, what the backend's ``ssu_engine_call`` hook
    returned for ``form`` (``"packed"`` or ``"verify"``), is callable with that form's parameters
    (:data:`ENGINE_CALL_PARAMETERS`) in order and with the same defaults."""
    protocol = ENGINE_CALL_PROTOCOLS[form]
    if not callable(fn):
        raise BackendError(
            f"backend {backend!r}: hook ssu_engine_call returned {type(fn).__name__} for the {form!r} call form, "
            f"not a callable of ssu.contract.{protocol.__name__}; fix the hook"
        )
    want = ENGINE_CALL_PARAMETERS[form]
    got = _mismatch(fn, want)
    if got is not None:
        raise BackendError(
            f"backend {backend!r}: its {form!r} call takes {describe(got)}; it needs {describe(want)} (the order "
            f"and defaults of ssu.contract.{protocol.__name__}). Fix what its ssu_engine_call hook returns"
        )
