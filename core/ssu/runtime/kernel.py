"""An opened kernel: the selected backend bound to one problem.

``ssu.open`` resolves the backend, validates its options, allocates its scratch and asks its
factory for the step callable once. ``Kernel.step`` is that callable itself when validation is
off, or a thin wrapper that validates once per input signature; no hook dispatch happens per step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..contract import devices
from ..state import faults
from ..plugins.config import Config, load_config
from ..contract import protocols
from ..contract.protocols import CacheLaneFn, LaneFn, StepFn, check_step
from ..contract.errors import BackendError, ConfigError, InputError
from ..contract.problem import Problem
from ..contract.records import Context, State
from ..plugins.registry import LoadedBackend, Registry, default_registry
from ..plugins.resolve import Resolution, resolve
from . import engine_calls
from .signatures import Signatures
from .validation import Checker


_CHECKED_BODY = """\
    try:
        known = token in state.checked
    except AttributeError:  # not a State: the full check names it
        known = False
    if not (known and type(layer) is int and 0 <= layer < state.num_layers and type(dt_softplus) is bool
            and seen({tensors})):
        checker.step(dict({arguments}))
        add({tensors})
        state.checked.add(token)
    if full:
        checker.slot_values(slots)
        if dst_slots is not None:
            checker.slot_values(dst_slots, name="dst_slots")
    state.stepped.add(layer)
    if guard is not None:
        slots = guard(slots, problem, record, SLOTS)
        if dst_slots is not None:
            dst_slots = guard(dst_slots, problem, record, DST_SLOTS)
"""


def _checked_step(kernel: "Kernel", raw: Callable, full: bool) -> StepFn:
    """``raw`` behind the checks: each new input signature fully, every call's cheap facts (the
    state, the layer), with ``full`` also slot values; ids outside the cache replaced by the pad id
    first for a backend that does not guard them itself. The wrapper's signature is the
    contract's (:func:`ssu.contract.define_step`), and it passes on the parameters the backend's
    plugin API knows."""
    checker = kernel._checker
    signatures = Signatures(static=checker.static_strides())
    api = kernel._api
    body = _CHECKED_BODY.format(
        tensors=signatures.arguments(), arguments=", ".join(f"{n}={n}" for n in protocols.STEP_NAMES)
    )
    namespace = dict(
        token=object(),  # in ``state.checked`` once the state passed this kernel's checks
        seen=signatures.seen,
        add=signatures.add,
        checker=checker,
        full=full,
        guard=None if kernel.capabilities.guards_slots else faults.guard,
        problem=kernel.problem,
        record=kernel._ctx.faults,
        SLOTS=faults.SLOTS,
        DST_SLOTS=faults.DST_SLOTS,
        raw=raw,
        **{f"NONE_{name}": t for name, t in signatures.placeholders.items()},
    )
    passed = tuple(p.name for p in protocols.expected_parameters(api))
    step = protocols.define_step(body, passed, namespace, f"ssu checked step of {kernel.backend}")
    step.__doc__ = StepFn.__doc__
    step.__wrapped__ = raw
    return step


class Kernel:
    """The selected backend bound to one :class:`~ssu.Problem`. Create it with :func:`ssu.open`."""

    #: the hot path (see :class:`ssu.contract.StepFn`): the backend's callable itself with
    #: ``validate = false``, else a wrapper checking each new input signature once
    step: StepFn

    def __init__(
        self,
        loaded: LoadedBackend,
        ctx: Context,
        resolution: Resolution,
        config: Config,
        registry: Optional[Registry] = None,
    ) -> None:
        self.backend: str = loaded.name
        self.problem: Problem = ctx.problem
        self.options: Any = ctx.options
        self.config = config
        self.resolution = resolution
        self.capabilities = loaded.spec.capabilities
        self.distribution = loaded.found.distribution
        self._loaded = loaded
        #: the plugin API the backend declares, (major, minor)
        self._api = tuple(int(p) for p in loaded.spec.api_version.split(".")[:2])
        self._registry = default_registry() if registry is None else registry
        self._ctx = ctx
        self._hook = loaded.hook
        self._checker = Checker(ctx.problem, loaded.name, loaded.spec.capabilities)
        try:
            raw = loaded.spec.factory(ctx)
        except BackendError:
            raise
        except Exception as exc:
            raise BackendError(
                f"backend {self.backend!r}: its factory failed for {ctx.problem.describe()}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not callable(raw):
            raise BackendError(
                f"backend {self.backend!r}: its factory returned {type(raw).__name__}, not a step callable"
            )
        check_step(raw, self.backend, loaded.spec.api_version)
        self.raw_step: StepFn = raw
        step = _checked_step(self, raw, full=config.validate == "full") if config.validate else raw
        #: with several GPUs visible, every launch runs with the problem's device current (None: no switch)
        self._launch_index = devices.launch_index(ctx.problem.device)
        self.step = devices.on_index(step, self._launch_index)
        self._commit_keys: set = set()
        #: vLLM's speculative call form (:class:`ssu.contract.PackedStepFn`), where the problem's
        #: ``engine_calls`` name ``"packed"``; else a callable that says how to open one
        self.packed_step: protocols.PackedStepFn = engine_calls.not_opened("packed", self.problem)
        #: SGLang's verify call form (:class:`ssu.contract.VerifyStepFn`), where the problem's
        #: ``engine_calls`` name ``"verify"`` (or ``"tree"``); else a callable that says how to open one
        self.verify_step: protocols.VerifyStepFn = engine_calls.not_opened("verify", self.problem)
        for form in engine_calls.forms_of(self.problem):
            bound = engine_calls.bind(
                self._hook,
                ctx,
                form,
                backend=self.backend,
                config=config,
                checker=self._checker,
                launch_index=self._launch_index,
            )
            setattr(self, f"{form}_step", bound)

    def lane(
        self,
        state: State,
        x,
        dt,
        A,
        B,
        C,
        slots,
        D=None,
        z=None,
        dt_bias=None,
        dt_softplus: bool = False,
        layer: int = 0,
    ) -> Optional[LaneFn]:
        """The backend's faster path for later one-token calls like this one, or None
        (:class:`ssu.contract.LaneFn`): call it with what changes between decode steps, ``lane(x,
        dt, A, B, C, D, z, dt_bias, dt_softplus)``, and call :attr:`step` when it returns None.
        Bind it after this call went through :attr:`step` once (a backend binds only layouts it
        has launched). With validation on this call is checked in full first, and the lane then
        checks every later call's layout against it, which is what the step's once-per-signature
        check amounts to; no lane is given with ``validate = "full"`` (slot values are checked
        every call), for a backend that leaves slot ids outside the cache to the core, or where
        launches switch devices. A lane leaves the layer out of the commit's account of stepped
        layers: for one-token steps without speculation, which commit nothing."""
        return self._bind("lane", (1, 6), state, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus)

    def cache_lane(
        self,
        state: State,
        x,
        dt,
        A,
        B,
        C,
        slots,
        D=None,
        z=None,
        dt_bias=None,
        dt_softplus: bool = False,
        layer: int = 0,
    ) -> Optional[CacheLaneFn]:
        """:meth:`lane` for an adopted ``state``, taking the tensor to step first
        (:class:`ssu.contract.CacheLaneFn`): ``lane(cache, x, dt, A, B, C, D, z, dt_bias,
        dt_softplus)`` steps ``cache``, the adopted tensor of ``layer`` or any tensor of its
        sizes, strides, dtype and device, which the kernel then steps as if it had adopted it (an
        engine that copies its cache before each step needs no adoption per step). None where the
        state is not adopted or the backend has no cache lane (plugin API 1.7); given under the
        same conditions as :meth:`lane`."""
        if not state.adopted:
            return None
        return self._bind("cache_lane", (1, 7), state, layer, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus)

    def _bind(self, attribute: str, since: tuple, state: State, layer: int, *call):
        """The backend's ``step.<attribute>`` bound for this call (plugin API ``since``), after
        the step's full check of the call, or None where lanes are not given."""
        bind = getattr(self.raw_step, attribute, None)
        if bind is None or self._api < since or self.problem.multi_token or self._launch_index is not None:
            return None
        if self.config.validate == "full" or (self.config.validate and not self.capabilities.guards_slots):
            return None
        if self.config.validate:
            x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus = call
            checked = dict(state=state, x=x, dt=dt, A=A, B=B, C=C, slots=slots, D=D, z=z, dt_bias=dt_bias)
            self._checker.step(dict(checked, dt_softplus=dt_softplus, out=None, layer=layer, dst_slots=None))
        return bind(state, layer, *call)

    # lifecycle ---------------------------------------------------------------------------------
    def allocate_state(self, num_layers: int = 1) -> State:
        """Allocate the (zero) state of a group of ``num_layers`` layers in the backend's layout."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ConfigError(f"num_layers must be a positive integer, got {num_layers!r}")
        with devices.guard(self._launch_index):
            state = self._hook.ssu_allocate_state(ctx=self._ctx, num_layers=num_layers)
        return self._returned_state(state, num_layers, "ssu_allocate_state")

    def adopt_state(self, cache, scales=None) -> State:
        """A :class:`State` whose logical state is the engine's own tensor: ``cache`` is one
        ``(num_slots, H, P, N)`` tensor (one layer), an ``(L, num_slots, H, P, N)`` tensor, or a
        sequence of per-layer tensors, in the state dtype, each slot's ``(H, P, N)`` block
        contiguous, any slot stride. Steps read and write it in place (same storage, no copy);
        after ``step`` (and ``commit``) ``cache[slot]`` holds the state, or after :meth:`sync`
        for a backend that keeps more than the logical state (see its docs). A quantised state
        dtype (``int8``, ``fp8_e4m3``) also takes ``scales``: each layer's fp32 row scales
        ``(num_slots, H, P)``, in the same forms, stepped in place with the cache."""
        if not self.capabilities.adopt_state:
            raise BackendError(
                f"backend {self.backend!r} cannot step an engine's cache in place (its capabilities "
                "do not declare adopt_state); allocate a state with kernel.allocate_state and hand "
                "states over with write_state / read_state, or choose a backend that adopts "
                "(reference, triton, flashinfer)"
            )
        layers = self._checker.cache(cache)
        scale_layers = self._checker.scales(scales, len(layers))
        with devices.guard(self._launch_index):
            state = self._hook.ssu_adopt_state(ctx=self._ctx, cache=layers, scales=scale_layers)
        state = self._returned_state(state, len(layers), "ssu_adopt_state")
        if tuple(state.cache) != tuple(layers) or any(a is not b for a, b in zip(state.cache, layers)):
            raise BackendError(
                f"backend {self.backend!r}: hook ssu_adopt_state returned a state whose cache is not "
                "the engine's tensors it was given"
            )
        return state

    def _returned_state(self, state: Any, num_layers: int, hook: str) -> State:
        if not isinstance(state, State) or state.num_layers != num_layers or state.backend != self.backend:
            raise BackendError(
                f"backend {self.backend!r}: hook {hook} returned {state!r}; expected an "
                f"ssu.State(backend={self.backend!r}, num_layers={num_layers})"
            )
        return state

    def sync(self, state: State, slots=None) -> None:
        """Make the engine's tensors of an adopted ``state`` hold the logical state of ``slots``
        (every slot when None): needed only by backends that keep more than the logical state
        between steps (:attr:`needs_sync`; triton-replay's rings are folded in here). The
        reference, triton and flashinfer backends keep the engine's tensor current after every
        step and commit, so this only checks."""
        self.check()
        self._checker.state(state, 0)
        if slots is not None:
            self._checker.read(state, slots, 0)
        with devices.guard(self._launch_index):
            self._hook.ssu_sync_state(ctx=self._ctx, state=state, slots=slots)

    def warmup(self, state: State) -> None:
        """Pay JIT compilation and tuning now (before serving or CUDA-graph capture).
        Every value of ``state`` is left as it was."""
        self._checker.state(state, 0)
        with devices.guard(self._launch_index):
            self._hook.ssu_warmup(ctx=self._ctx, state=state, step=self.raw_step)
        self.check()

    def commit(self, state: State, slots, num_accepted) -> None:  # the contract's CommitFn once bound
        """Speculative decoding: keep each sequence's first ``num_accepted[b]`` tokens of the last
        step, for every layer of ``state``. Once per step, after the last layer: every layer of
        the group must have been stepped with these slots since the previous commit (with
        validation on, a commit that finds a layer not stepped is refused and nothing moves).
        Counts outside ``1..T`` leave that slot as it was and are reported by :meth:`check` (with
        validation on, the core guards them for a backend that does not declare ``guards_slots``).
        Without speculation only backends with ``capabilities.layers_share_commit`` take a commit
        (of ones), when their options ask for explicit commits."""
        if self.config.validate:
            key = (
                id(state),
                slots.shape,
                slots.dtype,
                slots.device,
                slots.stride(),
                getattr(num_accepted, "shape", None),
                getattr(num_accepted, "stride", lambda: None)(),
                getattr(num_accepted, "dtype", None),
                getattr(num_accepted, "device", None),
            )
            if key not in self._commit_keys:
                self._checker.commit(state, slots, num_accepted)
                self._commit_keys.add(key)
            if self.config.validate == "full":
                self._checker.slot_values(slots)
                self._checker.accepted_values(num_accepted)
            self._checker.stepped(state)
            state.stepped.clear()
            if not self.capabilities.guards_slots:
                slots, num_accepted = faults.guard_commit(slots, num_accepted, self.problem, self._ctx.faults)
        if self._launch_index is None:
            self._hook.ssu_commit(ctx=self._ctx, state=state, slots=slots, num_accepted=num_accepted)
        else:
            with devices.guard(self._launch_index):
                self._hook.ssu_commit(ctx=self._ctx, state=state, slots=slots, num_accepted=num_accepted)

    def read_state(self, state: State, slots, layer: int = 0):
        """The logical state of ``slots`` in ``layer``: fp32, shape (len(slots), H, P, N)."""
        self.check()
        self._checker.read(state, slots, layer)
        with devices.guard(self._launch_index):
            return self._hook.ssu_read_state(ctx=self._ctx, state=state, slots=slots, layer=layer)

    def write_state(self, state: State, slots, values, layer: int = 0) -> None:
        """Install ``values`` (len(slots), H, P, N) as the logical state of ``slots`` in ``layer``."""
        self.check()
        self._checker.write(state, slots, values, layer)
        with devices.guard(self._launch_index):
            self._hook.ssu_write_state(ctx=self._ctx, state=state, slots=slots, values=values, layer=layer)

    def check(self) -> None:
        """Raise :class:`~ssu.InputError` if a step or commit since the last check met a slot id
        outside the cache (or an accepted count outside 1..T), naming the first such row; the
        record is cleared. It reads one number from the device (a synchronisation): call it where
        the engine synchronises anyway. See :mod:`ssu.state.faults`."""
        record = self._ctx.faults
        key = int(record.item())
        if key != faults.NO_FAULT:
            record.fill_(faults.NO_FAULT)
            raise InputError(faults.message(key, self.problem))

    def traffic(self, batch: int, accepted: Optional[float] = None, with_z: bool = True) -> dict:
        """The bytes one step of ``batch`` rows must move, by part (:mod:`ssu.measure.traffic`): the
        backend's own account (hook ``ssu_traffic``) or a write-every-step one, plus the step's
        inputs and outputs. ``accepted``: mean tokens a speculative step keeps (default all)."""
        from ..measure import traffic

        p = self.problem
        if not 1 <= batch <= p.max_batch:
            raise InputError(
                f"Kernel.traffic: batch={batch} is outside 1..max_batch={p.max_batch}; "
                "pass a batch this kernel was opened for, or open one with a larger max_batch"
            )
        kept = float(p.tokens_per_step if accepted is None else accepted)
        try:
            parts = self._hook.ssu_traffic(ctx=self._ctx, batch=batch, accepted=kept)
        except Exception as exc:
            raise BackendError(
                f"backend {self.backend!r}: hook ssu_traffic raised {type(exc).__name__}: {exc}; "
                "report this to the backend's authors"
            ) from exc
        if parts is None:
            return traffic.write_through(p, batch, with_z)
        if not isinstance(parts, dict) or not all(isinstance(v, (int, float)) for v in parts.values()):
            raise BackendError(
                f"backend {self.backend!r}: hook ssu_traffic returned {parts!r}, not a dict of byte counts; "
                "report this to the backend's authors"
            )
        return {**parts, "inputs and outputs": traffic.io_bytes(p, batch, with_z)}

    @property
    def needs_sync(self) -> bool:
        """Whether an adopted state's engine tensors are current only after :meth:`sync`: the
        backend keeps more than the logical state between steps (it implements the hook
        ``ssu_sync_state``). False: they hold the logical state after every step and commit."""
        return bool(self._hook.ssu_sync_state.get_hookimpls())

    @property
    def scratch(self) -> Any:
        """What the backend's ``ssu_allocate_scratch`` hook returned (None if nothing)."""
        return self._ctx.scratch

    def explain(self) -> str:
        """How this backend was chosen: the resolution trace with a reason per candidate, then
        every other installed backend's verdict for this problem (those are imported and probed
        now, as ``ssu explain`` does)."""
        from ..plugins.resolve import with_other_verdicts

        return with_other_verdicts(self.resolution, self.config, self._registry).explain()

    def __repr__(self) -> str:
        return f"<ssu.Kernel backend={self.backend!r} {self.problem.describe()}>"


def open_kernel(
    config: Optional[Config] = None,
    problem: Optional[Problem] = None,
    *,
    registry: Optional[Registry] = None,
    in_place: bool = False,
) -> Kernel:
    """Resolve the backend for ``problem`` under ``config`` and open a kernel.

    ``config=None`` loads ``ssu.toml`` / ``[tool.ssu]`` from the working directory (if any) and
    ``SSU_BACKEND``. Only the chosen backend (or, for lists and ``"auto"``, the ones tried) is
    imported. ``in_place``: the caller steps an engine's cache and never calls :meth:`Kernel.sync`
    (the drop-in call), so a backend that keeps state beside the cache (:attr:`Kernel.needs_sync`)
    is passed over (:func:`ssu.plugins.resolve.resolve`).
    """
    if problem is None:
        raise ConfigError("ssu.open needs a Problem, e.g. ssu.Problem(nheads=128, headdim=64, dstate=128, ngroups=8)")
    if not isinstance(problem, Problem):
        raise ConfigError(f"ssu.open: problem must be an ssu.Problem, got {type(problem).__name__}")
    config = load_config() if config is None else config
    if not isinstance(config, Config):
        raise ConfigError(f"ssu.open: config must be an ssu.Config (see ssu.load_config), got {type(config).__name__}")
    registry = default_registry() if registry is None else registry
    loaded, options, resolution = resolve(config, problem, registry, in_place=in_place)
    ctx = Context(problem, options, loaded.spec, faults=faults.allocate(problem.device))
    with devices.current(problem.device):  # launches and compiles on the problem's device
        ctx.scratch = loaded.hook.ssu_allocate_scratch(ctx=ctx)
        return Kernel(loaded, ctx, resolution, config, registry)
