"""The backend contract, as a pluggy hook specification (project name ``"ssu"``).

A backend is a module (or object) registered under the ``ssu.backends`` entry-point group whose
functions are marked with :data:`ssu.hookimpl`. The core imports it only when it is selected (or
probed), registers it alone in its own ``pluggy.PluginManager`` and calls ``check_pending``, so a
misspelled hook name fails at load time, naming the plugin and the hook. Lifecycle hooks are
therefore only ever called for the selected backend. The per-call ``step`` is not a hook: the
factory in :class:`~ssu.records.BackendSpec` returns it once and the kernel calls it directly.

Required hooks: ``ssu_backend``, ``ssu_allocate_state``, ``ssu_read_state``,
``ssu_write_state``, and ``ssu_commit`` if the capabilities declare ``speculative``.
Every other hook is optional and has the default documented on it.
"""

from __future__ import annotations

import pluggy

PROJECT = "ssu"
hookspec = pluggy.HookspecMarker(PROJECT)
#: mark a backend's hook implementations with this decorator
hookimpl = pluggy.HookimplMarker(PROJECT)

REQUIRED_HOOKS = ("ssu_backend", "ssu_allocate_state", "ssu_read_state", "ssu_write_state")


@hookspec(firstresult=True)
def ssu_backend():
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
def ssu_probe(device):
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
def ssu_supports(problem, options):
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
def ssu_allocate_state(ctx, num_layers):
    """Allocate the state of ``num_layers`` layers for ``ctx.problem``: return :class:`ssu.State`.

    The layout is the backend's own; values start at zero. Called outside the hot path.

    Example::

        @ssu.hookimpl
        def ssu_allocate_state(ctx, num_layers):
            p = ctx.problem
            ssm = torch.zeros(num_layers, p.num_slots, p.nheads, p.headdim, p.dstate,
                              dtype=ssu.dtypes.to_torch(p.state_dtype), device=p.device)
            return ssu.State("mine", p, num_layers, {"ssm": ssm})
    """


@hookspec(firstresult=True)
def ssu_allocate_scratch(ctx):
    """Allocate scratch buffers the step needs (sized for ``ctx.problem.max_batch``) before any
    CUDA-graph capture; the result is stored in ``ctx.scratch``. Default: no scratch.

    Example::

        @ssu.hookimpl
        def ssu_allocate_scratch(ctx):
            p = ctx.problem
            return torch.empty(p.max_batch, p.nheads, device=p.device)
    """


@hookspec(firstresult=True)
def ssu_warmup(ctx, state, step):
    """Pay JIT compilation and autotuning before serving. ``step`` is the kernel's step.

    Every value of ``state`` must be exactly as it was afterwards (tune on scratch copies or on
    spare slots that are restored). Default: nothing to do.

    Example::

        @ssu.hookimpl
        def ssu_warmup(ctx, state, step):
            ctx.memo["config"] = autotune(ctx.problem)     # times candidates on copies
    """


@hookspec(firstresult=True)
def ssu_commit(ctx, state, slots, num_accepted):
    """Speculative decoding: make each slot's logical state the state after its first
    ``num_accepted[b]`` tokens of the last step, for every layer of ``state``. Called once per
    step after the last layer; must be CUDA-graph capturable (no host synchronisation).

    Example::

        @ssu.hookimpl
        def ssu_commit(ctx, state, slots, num_accepted):
            state.buffers["cursor"][slots] += num_accepted
    """


@hookspec(firstresult=True)
def ssu_read_state(ctx, state, slots, layer):
    """Return the logical state of ``slots`` in ``layer`` as fp32, shape (len(slots), H, P, N).

    Example::

        @ssu.hookimpl
        def ssu_read_state(ctx, state, slots, layer):
            return state.buffers["ssm"][layer, slots.long()].float()
    """


@hookspec(firstresult=True)
def ssu_write_state(ctx, state, slots, values, layer):
    """Install ``values`` (len(slots), H, P, N) as the logical state of ``slots`` in ``layer``
    (e.g. states computed by prefill), rounding to the cache dtype.

    Example::

        @ssu.hookimpl
        def ssu_write_state(ctx, state, slots, values, layer):
            state.buffers["ssm"][layer, slots.long()] = values.to(state.buffers["ssm"].dtype)
    """
