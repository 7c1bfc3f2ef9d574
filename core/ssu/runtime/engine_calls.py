"""The engines' call forms on an opened kernel: ``kernel.packed_step`` (vLLM's) and
``kernel.verify_step`` (SGLang's), bound once when the kernel opens (docs/spec.md, "Engine call
forms").

For each form of ``Problem.engine_calls`` the backend's ``ssu_engine_call`` hook returns the
form's callable once; the kernel calls it directly. With validation on, a thin wrapper checks each
new input signature in full (:mod:`ssu.runtime.engine_checks`) and later calls compare the signature only;
with ``validate = "full"`` it also checks the values (a synchronisation). Backends that serve these
forms guard their ids themselves (``Capabilities.engine_calls`` needs ``guards_slots``), so no core
guard runs per call.
"""

from __future__ import annotations

from typing import Callable

from ..contract import protocols
from ..contract import devices
from . import engine_checks
from ..contract.errors import BackendError, InputError
from ..contract.records import State
from .signatures import Signatures

#: the tensors of each form's signature, in order (what :class:`~ssu.runtime.signatures.Signatures` compares)
PACKED_TENSORS = (
    "x",
    "dt",
    "A",
    "B",
    "C",
    "slots",
    "dst_slots",
    "num_accepted",
    "cu_seqlens",
    "D",
    "z",
    "dt_bias",
    "out",
)
VERIFY_TENSORS = ("x", "dt", "A", "B", "C", "slots", "D", "z", "dt_bias", "out", "buffer", "buffer_rows", "parents")
#: the tensors of each form that may be None
OPTIONAL = frozenset(
    {"dst_slots", "num_accepted", "cu_seqlens", "D", "z", "dt_bias", "out", "buffer", "buffer_rows", "parents"}
)
#: tensors whose strides are part of a form's signature: out, the per-head parameters, the id tables
STATIC = {"out": 0, "dt": 1, "A": 0, "D": 0, "dt_bias": 0, "slots": 0, "dst_slots": 0, "num_accepted": 0}
STATIC_VERIFY = {**STATIC, "buffer": 0, "buffer_rows": 0, "parents": 0}


def not_opened(form: str, problem) -> Callable:
    """What ``kernel.<form>_step`` is on a kernel opened without that form: a callable that says so."""
    attribute = f"{form}_step"

    def refuse(*args, **kwargs):
        raise InputError(
            f"kernel.{attribute}: this kernel was opened without the {form!r} call form ({problem.describe()}); "
            f"open it with Problem(engine_calls={{{form!r}}}, tokens_per_step=T), T the most tokens a sequence carries"
        )

    refuse.__name__ = attribute
    return refuse


def bind(hook, ctx, form: str, *, backend: str, config, checker, launch_index) -> Callable:
    """A kernel's callable of ``form`` (``"packed"`` or ``"verify"``): the backend's, checked
    against the form's protocol, behind the validation wrapper (on the kernel's ``checker``) when
    the ``config`` turns validation on, and a device guard where launches switch devices
    (``launch_index``)."""
    try:
        raw = hook.ssu_engine_call(ctx=ctx, form=form)
    except BackendError:
        raise
    except Exception as exc:
        raise BackendError(
            f"backend {backend!r}: hook ssu_engine_call failed for the {form!r} call form: {type(exc).__name__}: {exc}"
        ) from exc
    protocols.check_engine_call(raw, backend, form)
    fn = raw
    if config.validate:
        make = _checked_packed if form == "packed" else _checked_verify
        fn = make(checker, raw, full=config.validate == "full")
        fn.__wrapped__ = raw
    return devices.on_index(fn, launch_index)


def _signatures(names: tuple, static: dict) -> Signatures:
    return Signatures(static=static, names=names, optional=OPTIONAL)


def _arguments(names: tuple, values: dict, placeholders: dict) -> list:
    return [values[n] if values[n] is not None else placeholders[n] for n in names]


def _checked_packed(checker, raw: Callable, full: bool) -> protocols.PackedStepFn:
    """``raw`` (a :class:`~ssu.contract.PackedStepFn`) behind the packed form's checks."""
    signatures = _signatures(PACKED_TENSORS, STATIC)
    holders = signatures.placeholders
    token = object()

    def packed_step(
        state,
        x,
        dt,
        A,
        B,
        C,
        slots,
        dst_slots=None,
        num_accepted=None,
        cu_seqlens=None,
        D=None,
        z=None,
        dt_bias=None,
        dt_softplus=False,
        out=None,
        layer=0,
    ):
        call = dict(
            state=state, x=x, dt=dt, A=A, B=B, C=C, slots=slots, dst_slots=dst_slots, num_accepted=num_accepted,
            cu_seqlens=cu_seqlens, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus, out=out, layer=layer,
        )  # fmt: skip
        tensors = _arguments(PACKED_TENSORS, call, holders)
        known = isinstance(state, State) and token in state.checked
        if not (known and type(layer) is int and 0 <= layer < state.num_layers and type(dt_softplus) is bool):
            known = False
        if not (known and signatures.seen(*tensors)):
            engine_checks.packed(checker, call)
            signatures.add(*tensors)
            state.checked.add(token)
        if full:
            engine_checks.packed_values(checker, call)
        return raw(
            state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus, out, layer
        )

    packed_step.__doc__ = protocols.PackedStepFn.__doc__
    return packed_step


def _checked_verify(checker, raw: Callable, full: bool) -> protocols.VerifyStepFn:
    """``raw`` (a :class:`~ssu.contract.VerifyStepFn`) behind the verify form's checks."""
    signatures = _signatures(VERIFY_TENSORS, STATIC_VERIFY)
    holders = signatures.placeholders
    token = object()

    def verify_step(
        state,
        x,
        dt,
        A,
        B,
        C,
        slots,
        D=None,
        z=None,
        dt_bias=None,
        dt_softplus=False,
        out=None,
        layer=0,
        update_state=True,
        buffer=None,
        buffer_rows=None,
        parents=None,
    ):
        call = dict(
            state=state, x=x, dt=dt, A=A, B=B, C=C, slots=slots, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
            out=out, layer=layer, update_state=update_state, buffer=buffer, buffer_rows=buffer_rows, parents=parents,
        )  # fmt: skip
        tensors = _arguments(VERIFY_TENSORS, call, holders)
        known = isinstance(state, State) and token in state.checked
        if not (
            known
            and type(layer) is int
            and 0 <= layer < state.num_layers
            and type(dt_softplus) is bool
            and type(update_state) is bool
        ):
            known = False
        if not (known and signatures.seen(*tensors)):
            engine_checks.verify(checker, call)
            signatures.add(*tensors)
            state.checked.add(token)
        if full:
            engine_checks.verify_values(checker, call)
        return raw(
            state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, update_state, buffer, buffer_rows,
            parents,
        )  # fmt: skip

    verify_step.__doc__ = protocols.VerifyStepFn.__doc__
    return verify_step


def forms_of(problem) -> tuple:
    """The callables a kernel of ``problem`` binds: ``"packed"`` and/or ``"verify"`` (which serves
    ``"tree"`` too)."""
    calls = problem.engine_calls
    return tuple(f for f in ("packed", "verify") if f in calls)
