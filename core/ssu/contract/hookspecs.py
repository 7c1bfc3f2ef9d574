"""The backend contract, as a pluggy hook specification (project name ``"ssu"``).

A backend is a module (or object) registered under the ``ssu.backends`` entry-point group whose
functions are marked with :data:`ssu.hookimpl`. The core imports it only when it is selected (or
probed), registers it alone in its own ``pluggy.PluginManager`` and calls ``check_pending``, so a
misspelled hook name fails at load time, naming the plugin and the hook. Lifecycle hooks are
therefore only ever called for the selected backend. The per-call ``step`` is not a hook: the
factory in :class:`~ssu.contract.records.BackendSpec` returns it once (its signature is
:class:`ssu.contract.StepFn`, checked when the kernel opens) and the kernel calls it directly.

Required hooks: ``ssu_backend``, ``ssu_allocate_state``, ``ssu_read_state``,
``ssu_write_state``; ``ssu_commit`` if the capabilities declare ``speculative``;
``ssu_adopt_state`` if they declare ``adopt_state``; ``ssu_engine_call`` if they declare
``engine_calls``. Every other hook is optional and has the
default documented on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import pluggy

if TYPE_CHECKING:
    from torch import Tensor

    from .protocols import StepFn
    from .problem import Problem
    from .records import Availability, BackendSpec, Context, State, Verdict

PROJECT = "ssu"
hookspec = pluggy.HookspecMarker(PROJECT)
#: mark a backend's hook implementations with this decorator
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUIRED_HOOKS = ("ssu_backend", "ssu_allocate_state", "ssu_read_state", "ssu_write_state")


@hookspec(firstresult=True)
def ssu_backend() -> "BackendSpec":
    """Declare the backend: return a :class:`ssu.BackendSpec`. Called once, at load.

    Example::

        @ssu.hookimpl
        def ssu_backend():
            return ssu.BackendSpec(
                name="mine", api_version=ssu.PLUGIN_API_VERSION, factory=make_step,
                capabilities=ssu.Capabilities(devices={"cuda"}, state_dtypes={"fp32"}),
                options_class=MyOptions, description="my SSU kernel", url="https://example.org")
    """


@hookspec(firstresult=True)
def ssu_probe(device: str) -> Optional["Availability"]:
    """Can the backend run on ``device`` ("cpu", "cuda", "cuda:1") on this machine?

    Return :class:`ssu.Availability`; say why not and how to fix it. Import heavy libraries
    here or later, never at module import. Default: available.

    Example::

        @ssu.hookimpl
        def ssu_probe(device):
            if importlib.util.find_spec("mylib") is None:
                return ssu.Availability(False, "mylib is not installed", "pip install mylib")
            return ssu.Availability(True)
    """


@hookspec(firstresult=True)
def ssu_supports(problem: "Problem", options: Any) -> Optional["Verdict"]:
    """Backend-specific checks beyond the declared capabilities (which the core checks first).

    Return :class:`ssu.Verdict` (``ssu.Verdict.reject("reason", ...)`` or ``ssu.ACCEPT``).
    Default: accept.

    Example::

        @ssu.hookimpl
        def ssu_supports(problem, options):
            if options.algorithm == "vertical" and problem.tokens_per_step > 1:
                return ssu.Verdict.reject("algorithm 'vertical' with T > 1 needs SM100")
            return ssu.ACCEPT
    """


@hookspec(firstresult=True)
def ssu_allocate_state(ctx: "Context", num_layers: int) -> "State":
    """Allocate the state of ``num_layers`` layers for ``ctx.problem``: return :class:`ssu.State`.

    The layout is the backend's own; values start at zero. Called outside the hot path.

    Example::

        @ssu.hookimpl
        def ssu_allocate_state(ctx, num_layers):
            p = ctx.problem
            ssm = torch.zeros(num_layers, p.num_slots, p.nheads, p.headdim, p.dstate,
                              dtype=ssu.contract.dtypes.to_torch(p.state_dtype), device=p.device)
            return ssu.State("mine", p, num_layers, {"ssm": ssm})
    """


@hookspec(firstresult=True)
def ssu_adopt_state(ctx: "Context", cache: tuple["Tensor", ...], scales: tuple["Tensor", ...]) -> "State":
    """Adopt an engine's cache: ``cache`` holds each layer's tensor ``(num_slots, H, P, N)`` in
    the state dtype, already checked by the core (each slot's ``(H, P, N)`` block contiguous, any
    slot stride). Return an :class:`ssu.State` with ``cache`` set to those tensors: steps read and
    write them in place. Allocate only side buffers (speculative drafts, rings). Required when
    the capabilities declare ``adopt_state``. ``scales`` (plugin API 1.5) holds, for a quantised
    state dtype, each layer's fp32 row scales ``(num_slots, H, P)``, checked by the core and
    stepped in place with the cache; empty otherwise. An implementation that serves no quantised
    dtype may leave the argument out.

    Example::

        @ssu.hookimpl
        def ssu_adopt_state(ctx, cache):
            return ssu.State("mine", ctx.problem, len(cache), {}, cache=cache)
    """


@hookspec(firstresult=True)
def ssu_sync_state(ctx: "Context", state: "State", slots: Optional["Tensor"]) -> None:
    """Make the engine's tensors of an adopted ``state`` hold the logical state of ``slots``
    (every slot when None), for an engine that reads its cache itself (its prefill, say). A
    backend whose steps and commits keep the engine's tensor current implements nothing: the
    default does nothing.

    Example::

        @ssu.hookimpl
        def ssu_sync_state(ctx, state, slots):
            fold_ring_into_checkpoint(state, slots)
    """


@hookspec(firstresult=True)
def ssu_allocate_scratch(ctx: "Context") -> Any:
    """Allocate scratch buffers the step needs (sized for ``ctx.problem.max_batch``) before any
    CUDA-graph capture; the result is stored in ``ctx.scratch``. Default: no scratch.

    Example::

        @ssu.hookimpl
        def ssu_allocate_scratch(ctx):
            p = ctx.problem
            return torch.empty(p.max_batch, p.nheads, device=p.device)
    """


@hookspec(firstresult=True)
def ssu_warmup(ctx: "Context", state: "State", step: "StepFn") -> None:
    """Pay JIT compilation and autotuning before serving. ``step`` is the kernel's step.

    Every value of ``state`` must be exactly as it was afterwards (tune on scratch copies or on
    spare slots that are restored). Default: nothing to do.

    Example::

        @ssu.hookimpl
        def ssu_warmup(ctx, state, step):
            ctx.memo["config"] = autotune(ctx.problem)     # times candidates on copies
    """


@hookspec(firstresult=True)
def ssu_traffic(ctx: "Context", batch: int, accepted: float) -> Optional[dict]:
    """The bytes one step of ``batch`` rows moves in device memory, by part (a dict of name to
    bytes, each byte counted once), for a backend that does not read each state once and write it
    once per token; ``accepted`` is the mean tokens a speculative step keeps (the commit's
    ``num_accepted``), ``tokens_per_step`` otherwise. ``ssu bench`` prints each row against it.
    Default: the write-every-step traffic (:func:`ssu.measure.traffic.write_through`); the step's inputs
    and outputs are added by the core. Called outside the hot path only.

    Example::

        @ssu.hookimpl
        def ssu_traffic(ctx, batch, accepted):
            slot = ctx.problem.state_bytes_per_slot()
            return {"checkpoint read": batch * slot, "checkpoint write": batch * slot / 16}
    """


@hookspec(firstresult=True)
def ssu_engine_call(ctx: "Context", form: str) -> Any:
    """Return the callable of one engine call form (plugin API 1.8) for the kernel of ``ctx``:
    ``"packed"`` (vLLM's, :class:`ssu.contract.PackedStepFn`) or ``"verify"`` (SGLang's,
    :class:`ssu.contract.VerifyStepFn`; it also serves ``"tree"``'s parent tokens where the
    capabilities declare ``"tree"``). Called once per kernel and form, when the kernel opens, for
    each form of ``ctx.problem.engine_calls``; the callable is the hot path of that form, called
    directly (no hook dispatch, no allocation but an ``out`` not given, no host synchronisation).
    Required when the capabilities declare ``engine_calls``. Semantics: docs/spec.md, "Engine call
    forms".

    Example::

        @ssu.hookimpl
        def ssu_engine_call(ctx, form):
            return make_packed_step(ctx) if form == "packed" else make_verify_step(ctx)
    """


@hookspec(firstresult=True)
def ssu_commit(ctx: "Context", state: "State", slots: "Tensor", num_accepted: "Tensor") -> None:
    """Speculative decoding: make each slot's logical state the state after its first
    ``num_accepted[b]`` tokens of the last step, for every layer of ``state``. Called once per
    step after the last layer; must be CUDA-graph capturable (no host synchronisation). A
    backend that declares ``guards_slots`` leaves slots outside the cache, and counts outside
    ``1..T``, as they were and records them in ``ctx.faults``.

    Example::

        @ssu.hookimpl
        def ssu_commit(ctx, state, slots, num_accepted):
            state.buffers["cursor"][slots] += num_accepted
    """


@hookspec(firstresult=True)
def ssu_read_state(ctx: "Context", state: "State", slots: "Tensor", layer: int) -> "Tensor":
    """Return the logical state of ``slots`` in ``layer`` as fp32, shape (len(slots), H, P, N).

    Example::

        @ssu.hookimpl
        def ssu_read_state(ctx, state, slots, layer):
            return state.buffers["ssm"][layer, slots.long()].float()
    """


@hookspec(firstresult=True)
def ssu_write_state(ctx: "Context", state: "State", slots: "Tensor", values: "Tensor", layer: int) -> None:
    """Install ``values`` (len(slots), H, P, N) as the logical state of ``slots`` in ``layer``
    (e.g. states computed by prefill), rounding to the cache dtype.

    Example::

        @ssu.hookimpl
        def ssu_write_state(ctx, state, slots, values, layer):
            state.buffers["ssm"][layer, slots.long()] = values.to(state.buffers["ssm"].dtype)
    """
