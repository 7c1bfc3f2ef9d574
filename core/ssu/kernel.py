"""An opened kernel: the selected backend bound to one problem.

``ssu.open`` resolves the backend, validates its options, allocates its scratch and asks its
factory for the step callable once. ``Kernel.step`` is that callable itself when validation is
off, or a thin wrapper that validates once per input signature; no hook dispatch happens per step.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .config import Config, load_config
from .errors import BackendError, ConfigError
from .problem import Problem
from .records import Context, State
from .registry import LoadedBackend, Registry, default_registry
from .resolve import Resolution, resolve
from .validation import Checker, step_key

#: at most this many input signatures are remembered per kernel before the memory is reset
_MAX_SIGNATURES = 1024


def _checked_step(raw: Callable, checker: Checker, full: bool) -> Callable:
    """Wrap ``raw`` so that each new input signature is checked once (every call if ``full``)."""
    seen: set = set()

    def step(state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0):
        try:
            key = step_key(state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer)
        except AttributeError:  # not a tensor: the full check names the argument
            key = None
        if key is None or key not in seen:
            checker.step(state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer)
            if len(seen) >= _MAX_SIGNATURES:
                seen.clear()
            seen.add(key)
        if full:
            checker.slot_values(slots)
        return raw(state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer)

    step.__doc__ = Kernel.step.__doc__
    step.__wrapped__ = raw
    return step


class Kernel:
    """The selected backend bound to one :class:`~ssu.Problem`. Create it with :func:`ssu.open`."""

    def __init__(self, loaded: LoadedBackend, ctx: Context, resolution: Resolution, config: Config) -> None:
        self.backend: str = loaded.name
        self.problem: Problem = ctx.problem
        self.options: Any = ctx.options
        self.config = config
        self.resolution = resolution
        self.capabilities = loaded.spec.capabilities
        self.distribution = loaded.found.distribution
        self._loaded = loaded
        self._ctx = ctx
        self._hook = loaded.hook
        caps = loaded.spec.capabilities
        self._checker = Checker(ctx.problem, loaded.name, caps.index_dtypes, caps.layers_share_commit)
        try:
            raw = loaded.spec.factory(ctx)
        except BackendError:
            raise
        except Exception as exc:
            raise BackendError(f"backend {self.backend!r}: its factory failed for {ctx.problem.describe()}: "
                               f"{type(exc).__name__}: {exc}") from exc
        if not callable(raw):
            raise BackendError(f"backend {self.backend!r}: its factory returned {type(raw).__name__}, not a step callable")
        self.raw_step: Callable = raw
        if config.validate:
            self.step = _checked_step(raw, self._checker, full=config.validate == "full")
        else:
            self.step = raw
        self._commit_keys: set = set()

    def step(self, state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False,
             out=None, layer=0):  # pragma: no cover - replaced per instance in __init__
        """The hot path: one SSU step of ``layer`` for a batch; returns ``out``.

        x (b, H, P), or (b, T, H, P) for a speculative kernel; dt (b, [T,] H); A (H,) fp32;
        B, C (b, [T,] G, N); slots (b,) int32/int64 with pad id rows; D, dt_bias (H,) and z
        (like x) optional. Writes ``out`` (allocated if None). No hook dispatch, no host sync.
        """
        raise NotImplementedError

    # lifecycle ---------------------------------------------------------------------------------
    def allocate_state(self, num_layers: int = 1) -> State:
        """Allocate the (zero) state of a group of ``num_layers`` layers in the backend's layout."""
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ConfigError(f"num_layers must be a positive integer, got {num_layers!r}")
        state = self._hook.ssu_allocate_state(ctx=self._ctx, num_layers=num_layers)
        if not isinstance(state, State) or state.num_layers != num_layers or state.backend != self.backend:
            raise BackendError(f"backend {self.backend!r}: hook ssu_allocate_state returned {state!r}; expected an "
                               f"ssu.State(backend={self.backend!r}, num_layers={num_layers})")
        return state

    def warmup(self, state: State) -> None:
        """Pay JIT compilation and tuning now (before serving or CUDA-graph capture).
        Every value of ``state`` is left as it was."""
        self._checker.state(state, 0)
        self._hook.ssu_warmup(ctx=self._ctx, state=state, step=self.raw_step)

    def commit(self, state: State, slots, num_accepted) -> None:
        """Speculative decoding: keep each sequence's first ``num_accepted[b]`` tokens of the last
        step, for every layer of ``state``. Once per step, after the last layer: every layer of
        the group must have been stepped with these slots since the previous commit. Without
        speculation only backends with ``capabilities.layers_share_commit`` take a commit (of
        ones), when their options ask for explicit commits."""
        if self.config.validate:
            key = (id(state), slots.shape, slots.dtype, slots.device,
                   getattr(num_accepted, "shape", None), getattr(num_accepted, "dtype", None),
                   getattr(num_accepted, "device", None))
            if key not in self._commit_keys:
                self._checker.commit(state, slots, num_accepted)
                self._commit_keys.add(key)
            if self.config.validate == "full":
                self._checker.slot_values(slots)
                self._checker.accepted_values(num_accepted)
        self._hook.ssu_commit(ctx=self._ctx, state=state, slots=slots, num_accepted=num_accepted)

    def read_state(self, state: State, slots, layer: int = 0):
        """The logical state of ``slots`` in ``layer``: fp32, shape (len(slots), H, P, N)."""
        self._checker.read(state, slots, layer)
        return self._hook.ssu_read_state(ctx=self._ctx, state=state, slots=slots, layer=layer)

    def write_state(self, state: State, slots, values, layer: int = 0) -> None:
        """Install ``values`` (len(slots), H, P, N) as the logical state of ``slots`` in ``layer``."""
        self._checker.write(state, slots, values, layer)
        self._hook.ssu_write_state(ctx=self._ctx, state=state, slots=slots, values=values, layer=layer)

    @property
    def scratch(self) -> Any:
        """What the backend's ``ssu_allocate_scratch`` hook returned (None if nothing)."""
        return self._ctx.scratch

    def explain(self) -> str:
        """How this backend was chosen: the resolution trace with a reason per candidate."""
        return self.resolution.explain()

    def __repr__(self) -> str:
        return f"<ssu.Kernel backend={self.backend!r} {self.problem.describe()}>"


def open_kernel(config: Optional[Config] = None, problem: Optional[Problem] = None, *,
                registry: Optional[Registry] = None) -> Kernel:
    """Resolve the backend for ``problem`` under ``config`` and open a kernel.

    ``config=None`` loads ``ssu.toml`` / ``[tool.ssu]`` from the working directory (if any) and
    ``SSU_BACKEND``. Only the chosen backend (or, for lists and ``"auto"``, the ones tried) is
    imported.
    """
    if problem is None:
        raise ConfigError("ssu.open needs a Problem, e.g. ssu.Problem(nheads=128, headdim=64, dstate=128, ngroups=8)")
    if not isinstance(problem, Problem):
        raise ConfigError(f"ssu.open: problem must be an ssu.Problem, got {type(problem).__name__}")
    config = load_config() if config is None else config
    if not isinstance(config, Config):
        raise ConfigError(f"ssu.open: config must be an ssu.Config (see ssu.load_config), got {type(config).__name__}")
    registry = default_registry() if registry is None else registry
    loaded, options, resolution = resolve(config, problem, registry)
    ctx = Context(problem, options, loaded.spec)
    ctx.scratch = loaded.hook.ssu_allocate_scratch(ctx=ctx)
    return Kernel(loaded, ctx, resolution, config)
