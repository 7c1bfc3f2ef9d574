"""vLLM running its Mamba2 SSU through ssu: a plugin of vLLM's ``vllm.general_plugins`` entry-point
group (named ``ssu``, registered by ssu-core), which vLLM loads in every process it starts.

Where the serving process names an ssu backend (``SSU_BACKEND``, or ``backend`` in ``ssu.toml`` /
``[tool.ssu]``), :func:`register` checks that configuration at once (an unknown name, a broken
backend or a bad option raises, and vLLM, which lets a general plugin's error through, stops at
startup with ssu's message), then puts an ssu class in every entry of vLLM's SSU registry
(``ssu_dispatch._BACKEND_REGISTRY``: triton, flashinfer, cpu), each standing in for the class it
replaced. Whichever Mamba SSU backend vLLM's config selects, ``initialize_mamba_ssu_backend``
instantiates its stand-in, which logs which of vLLM's backends it stands in for; every call of
vLLM's dispatch ``selective_state_update`` (the decode SSU of ``MambaMixer2``: one token a
request, or the speculative form with ``cu_seqlens`` and ``num_accepted_tokens``) runs through
:func:`ssu.selective_state_update` on vLLM's own cache, in place. A call ssu does not serve (a
Mamba-1 layer's: ``MambaMixer`` calls the same dispatch; a problem no configured backend accepts)
goes to the vLLM backend the stand-in replaced, with the same arguments, said once per problem
(a problem of one batch bucket leaves the calls of the others with ssu).
Without a configuration :func:`register` returns at once and vLLM is untouched. vLLM's
``VLLM_PLUGINS`` allowlist applies as to any plugin (``VLLM_PLUGINS=ssu``); an allowlist that
leaves ssu out keeps every ssu module unloaded, so ssu cannot say so itself.

Not routed: the prefill's chunked scan, the convolutions, and ReplaySSM (``--use-replayssm``),
whose decode calls do not go through the dispatch (said at startup when vLLM turns it on).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger("vllm.ssu")

#: vLLM's own classes in the registry entries :func:`route` replaced, to stand in for and to put
#: back (:func:`unregister`)
_replaced: dict = {}
#: the drop-in listener that logs which backend serves each kernel it opens
_announce = None


def register() -> None:
    """vLLM's entry point: route vLLM's SSU dispatch through ssu where this process names a backend;
    raise (stopping vLLM) where that configuration is wrong."""
    from .engines import configured

    config = configured()
    if config is None:
        return
    route(config)


def route(config) -> None:
    """Put an ssu class, serving with ``config`` (an :class:`ssu.Config`), in every entry of vLLM's
    SSU registry, each standing in for vLLM's class there (what :func:`register` does once it has
    found and checked a configuration)."""
    from vllm.model_executor.layers.mamba.ops import ssu_dispatch

    from .. import dropin
    from .engines import announce

    global _announce
    registry = ssu_dispatch._BACKEND_REGISTRY
    for key in list(registry):
        if not getattr(registry[key], "routes_to_ssu", False):
            _replaced[key] = registry[key]
        registry[key] = ssu_class(ssu_dispatch, config, _name(key), _replaced[key])
    if _announce is None:
        _announce = announce("vLLM", logger)
        dropin.on_open.append(_announce)
    logger.info(
        "ssu routes vLLM's Mamba2 SSU dispatch to backend %s (%s), in place of the Mamba SSU backend vLLM selects "
        "(one of %s); calls ssu does not serve go to that backend",
        ", ".join(config.candidates), config.source, ", ".join(_name(k) for k in registry),
    )  # fmt: skip


def _name(key: Any) -> str:
    """A registry key as vLLM's config names it (``MambaBackendEnum.CPU`` -> ``cpu``)."""
    return str(getattr(key, "value", key))


def unregister() -> None:
    """Put vLLM's own SSU classes back (for tests; a serving process keeps the routing)."""
    from vllm.model_executor.layers.mamba.ops import ssu_dispatch

    from .. import dropin

    global _announce
    ssu_dispatch._BACKEND_REGISTRY.update(_replaced)
    _replaced.clear()
    if _announce in dropin.on_open:
        dropin.on_open.remove(_announce)
    _announce = None


def _say_replayssm() -> None:
    """Warn where the vLLM config being initialised runs ReplaySSM, whose decode calls do not reach
    the dispatch (vLLM sets its config as current while its workers initialise their KV caches)."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - an older vLLM
        return
    current = get_current_vllm_config_or_none()
    if getattr(getattr(current, "cache_config", None), "use_replayssm", False):
        logger.warning(
            "vLLM runs ReplaySSM (--use-replayssm): its Mamba2 decode calls bypass the SSU dispatch, so ssu serves "
            "none of them (only calls that still reach the dispatch, such as Mamba-1 layers'); leave --use-replayssm "
            "off to run the Mamba2 SSU through ssu"
        )


def ssu_class(ssu_dispatch, config, own_name: str, own_class: type) -> type:
    """The ``MambaSSUBackend`` of ``ssu_dispatch`` (vLLM's module) whose calls ssu serves with
    ``config``, standing in for ``own_class`` (vLLM's class registered as ``own_name``), to which it
    passes the calls ssu does not serve."""
    from ..dropin import selective_state_update
    from ..dropin.engines import call_form
    from .call_check import checking, wanted
    from .engines import NOT_SERVED, Passed

    null_block = getattr(ssu_dispatch, "NULL_BLOCK_ID", 0)
    serve = selective_state_update
    if wanted():
        serve = checking(serve, "vLLM", logger, wanted())

    class SSUMambaBackend(ssu_dispatch.MambaSSUBackend):
        """vLLM's Mamba SSU backend interface served by ssu: each call goes to
        :func:`ssu.selective_state_update` with the engine's own arguments (vLLM's packed
        speculative form included) on vLLM's cache; a call ssu does not serve goes to vLLM's own
        backend that this class stands in for. vLLM's stochastic-rounding settings are not read:
        the ssu backend's own options (``[ssu.backends.<name>]``) decide."""

        routes_to_ssu = True
        #: vLLM's class this one stands in for, and its name in vLLM's config
        replaces = own_class
        replaces_name = own_name

        def __init__(self, mamba_config: Any) -> None:
            super().__init__(mamba_config)
            self._engine_config = mamba_config
            self._own: Optional[Any] = None
            self._passed = Passed("vLLM", logger)
            logger.info(
                "ssu stands in for vLLM's %r Mamba SSU backend (%s), serving with backend %s; calls ssu does not "
                "serve go to vLLM's", own_name, own_class.__name__, ", ".join(config.candidates),
            )  # fmt: skip
            _say_replayssm()

        @property
        def name(self) -> str:
            return "ssu"

        def own(self) -> Any:
            """vLLM's own backend this class stands in for, built at its first call."""
            if self._own is None:
                self._own = own_class(self._engine_config)
            return self._own

        def __call__(
            self,
            state: Any,
            x: Any,
            dt: Any,
            A: Any,
            B: Any,
            C: Any,
            D: Any,
            dt_bias: Any,
            z: Any = None,
            dt_softplus: bool = False,
            state_batch_indices: Any = None,
            dst_state_batch_indices: Any = None,
            null_block_id: int = null_block,
            out: Any = None,
            num_accepted_tokens: Any = None,
            cu_seqlens: Any = None,
            is_blackwell: bool = False,
        ) -> None:
            passed = self._passed
            if not passed or not passed.passes(state, call_form(x, state_batch_indices,
                                               num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens),
                                               x, state_batch_indices, cu_seqlens):  # fmt: skip
                try:
                    serve(
                        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                        dst_state_batch_indices, out=out, null_block_id=null_block_id,
                        num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens, config=config,
                    )  # fmt: skip
                    return
                except NOT_SERVED as exc:
                    form = call_form(x, state_batch_indices, num_accepted_tokens=num_accepted_tokens,
                                     cu_seqlens=cu_seqlens)  # fmt: skip
                    passed.add(state, x, form, exc, repr(own_name), state_batch_indices, cu_seqlens)
            self.own()(
                state, x, dt, A, B, C, D, dt_bias, z=z, dt_softplus=dt_softplus,
                state_batch_indices=state_batch_indices, dst_state_batch_indices=dst_state_batch_indices,
                null_block_id=null_block_id, out=out, num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens,
                is_blackwell=is_blackwell,
            )  # fmt: skip

    return SSUMambaBackend


def serving() -> Optional[type]:
    """The ssu class in vLLM's registry, where :func:`register` routed it (None otherwise)."""
    if not _replaced:
        return None
    from vllm.model_executor.layers.mamba.ops import ssu_dispatch

    return next(iter(ssu_dispatch._BACKEND_REGISTRY.values()))
