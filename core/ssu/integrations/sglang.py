"""SGLang running its Mamba2 SSU through ssu: a plugin of SGLang's ``sglang.srt.plugins`` entry-point
group (named ``ssu``, registered by ssu-core), which SGLang's ``load_plugins`` runs in every
process it starts (the engine, each scheduler).

Where the serving process names an ssu backend (``SSU_BACKEND``, or ``backend`` in ``ssu.toml`` /
``[tool.ssu]``), :func:`register` checks that configuration and adds, through SGLang's hook
registry, a hook around ``initialize_mamba_selective_state_update_backend`` (which the scheduler
calls from ``Scheduler.init_mamba_backend`` before it loads the model): SGLang initialises its own
SSU backend as it always does (its ``--mamba-backend`` checks included), and the hook then puts an
ssu backend in its place, so that every call of SGLang's dispatch ``selective_state_update`` (a
decode step, or the verify call of speculative decoding with its intermediate-state buffer and
EAGLE parent tokens) runs through :func:`ssu.selective_state_update` on SGLang's own cache, in
place. A call ssu does not serve (a Mamba-1 layer's: SGLang's ``mamba1.py`` calls the same
dispatch; a problem no configured backend accepts) goes to SGLang's own backend, with the same
arguments, said once per problem.

SGLang's plugin loader logs a plugin's error and carries on, so a wrong configuration cannot stop
SGLang where the plugin loads: :func:`register` logs it and hooks the same initialisation to raise
it, which stops the scheduler before it serves. Without a configuration :func:`register` returns at
once and SGLang is untouched. SGLang's ``SGLANG_PLUGINS`` allowlist applies as to any plugin
(``SGLANG_PLUGINS=ssu``; SGLang logs "Skipping plugin ssu" for an allowlist that leaves it out).

Not routed: the prefill's chunked scan, the convolutions, and the copy of accepted states from the
buffer into the cache after verification, which SGLang does itself.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("sglang.ssu")

#: what the hook wraps: SGLang's initialisation of its SSU backend
TARGET = "sglang.kernels.ops.mamba.triton_ops.ssu_dispatch.initialize_mamba_selective_state_update_backend"
_announce = None


def register() -> None:
    """SGLang's entry point: route SGLang's SSU dispatch through ssu where this process names a
    backend; where that configuration is wrong, make SGLang's SSU initialisation raise why."""
    from ..contract.errors import SSUError
    from .engines import configured

    try:
        config = configured()
    except SSUError as exc:
        logger.error("ssu cannot serve SGLang's Mamba2 SSU: %s", exc)
        hook = refuse(exc)
    else:
        if config is None:
            return
        hook = around_initialize(config)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, hook, HookType.AROUND)


def refuse(error: Exception):
    """The hook for a configuration that cannot serve: SGLang's SSU initialisation raises ``error``."""

    def initialize(original, *args, **kwargs):
        raise error

    return initialize


def around_initialize(config):
    """The hook: SGLang's own initialisation, then an ssu backend serving with ``config`` in its place."""

    def initialize(original, *args, **kwargs):
        result = original(*args, **kwargs)
        route(config)
        return result

    return initialize


def route(config) -> None:
    """Put an ssu backend, serving with ``config``, in SGLang's dispatch in place of the one SGLang
    initialised (what the hook does after SGLang's own initialisation)."""
    from sglang.kernels.ops.mamba.triton_ops import ssu_dispatch

    from .. import dropin
    from .engines import announce

    global _announce
    own = ssu_dispatch._mamba_ssu_backend
    own = getattr(own, "replaces", own)  # routed before: stand in for SGLang's own again
    ssu_dispatch._mamba_ssu_backend = ssu_class(ssu_dispatch, config)(own)
    if _announce is None:
        _announce = announce("SGLang", logger)
        dropin.on_open.append(_announce)
    logger.info(
        "ssu routes SGLang's Mamba2 SSU dispatch to backend %s (%s), in place of SGLang's %r backend (%s); calls ssu "
        "does not serve go to that backend",
        ", ".join(config.candidates), config.source, getattr(own, "name", "?"), type(own).__name__,
    )  # fmt: skip


def unregister() -> None:
    """Forget the listener (for tests; SGLang's dispatch is initialised again by its own call)."""
    from .. import dropin

    global _announce
    if _announce in dropin.on_open:
        dropin.on_open.remove(_announce)
    _announce = None


def ssu_class(ssu_dispatch, config) -> type:
    """The ``MambaSSUBackend`` of ``ssu_dispatch`` (SGLang's module) whose calls ssu serves with
    ``config``; an instance takes SGLang's own backend, to which it passes the calls ssu does not
    serve."""
    from ..dropin import selective_state_update
    from ..dropin.engines import call_form
    from .call_check import checking, wanted
    from .engines import NOT_SERVED, Passed

    serve = selective_state_update
    if wanted():
        serve = checking(serve, "SGLang", logger, wanted())

    class SSUMambaBackend(ssu_dispatch.MambaSSUBackend):
        """SGLang's Mamba SSU backend interface served by ssu: each call goes to
        :func:`ssu.selective_state_update` with the engine's own arguments (the verify form
        included) on SGLang's cache; a call ssu does not serve goes to SGLang's own backend
        (``replaces``). SGLang's stochastic-rounding settings are not read: the ssu backend's own
        options (``[ssu.backends.<name>]``) decide."""

        routes_to_ssu = True

        def __init__(self, replaces: Any) -> None:
            #: SGLang's own backend, which serves the calls ssu does not
            self.replaces = replaces
            self._passed = Passed("SGLang", logger)

        @property
        def name(self) -> str:
            return "ssu"

        def __call__(
            self,
            state: Any,
            x: Any,
            dt: Any,
            A: Any,
            B: Any,
            C: Any,
            D: Any = None,
            z: Any = None,
            dt_bias: Any = None,
            dt_softplus: bool = False,
            state_batch_indices: Any = None,
            pad_slot_id: int = -1,
            out: Any = None,
            disable_state_update: bool = False,
            intermediate_states_buffer: Any = None,
            cache_steps: Any = None,
            retrieve_parent_token: Any = None,
            intermediate_state_indices: Any = None,
        ) -> None:
            passed = self._passed
            if not passed or not passed.passes(state, self._form(x, disable_state_update, intermediate_states_buffer,
                                                                 retrieve_parent_token), x):  # fmt: skip
                try:
                    serve(
                        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, None, pad_slot_id,
                        out, disable_state_update=disable_state_update,
                        intermediate_states_buffer=intermediate_states_buffer, cache_steps=cache_steps,
                        retrieve_parent_token=retrieve_parent_token,
                        intermediate_state_indices=intermediate_state_indices, config=config,
                    )  # fmt: skip
                    return
                except NOT_SERVED as exc:
                    form = self._form(x, disable_state_update, intermediate_states_buffer, retrieve_parent_token)
                    passed.add(state, x, form, exc, repr(getattr(self.replaces, "name", "?")))
            self.replaces(
                state, x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                state_batch_indices=state_batch_indices, pad_slot_id=pad_slot_id, out=out,
                disable_state_update=disable_state_update, intermediate_states_buffer=intermediate_states_buffer,
                cache_steps=cache_steps, retrieve_parent_token=retrieve_parent_token,
                intermediate_state_indices=intermediate_state_indices,
            )  # fmt: skip

        @staticmethod
        def _form(x, disable_state_update, buffer, parents) -> str:
            return call_form(x, disable_state_update=disable_state_update, intermediate_states_buffer=buffer,
                             retrieve_parent_token=parents)  # fmt: skip

    return SSUMambaBackend
