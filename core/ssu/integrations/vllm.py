"""vLLM running its Mamba2 SSU through ssu: a plugin of vLLM's ``vllm.general_plugins`` entry-point
group (named ``ssu``, registered by ssu-core), which vLLM loads in every process it starts.

Where the serving process names an ssu backend (``SSU_BACKEND``, or ``backend`` in ``ssu.toml`` /
``[tool.ssu]``; :func:`ssu.integrations.engines.configured`), :func:`register` puts an ssu class in
every entry of vLLM's SSU registry (``ssu_dispatch._BACKEND_REGISTRY``: triton, flashinfer, cpu),
so that whichever Mamba SSU backend vLLM's config selects, ``initialize_mamba_ssu_backend``
instantiates it and every call of vLLM's dispatch ``selective_state_update`` (the decode SSU of
``MambaMixer2``: one token a request, or the speculative form with ``cu_seqlens`` and
``num_accepted_tokens``) runs through :func:`ssu.selective_state_update` on vLLM's own cache, in
place. Without such a configuration :func:`register` returns at once and vLLM is untouched.
vLLM's ``VLLM_PLUGINS`` allowlist applies as to any plugin (``VLLM_PLUGINS=ssu``).

Not routed: the prefill's chunked scan, the convolutions, and ReplaySSM (``use_replayssm``), whose
calls do not go through the dispatch.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

logger = logging.getLogger("vllm.ssu")

#: the registry entries :func:`register` replaced, to put back (:func:`unregister`)
_replaced: dict = {}
#: the drop-in listener that logs which backend serves each kernel it opens
_announce = None


def register() -> None:
    """vLLM's entry point: route vLLM's SSU dispatch through ssu where this process names a backend."""
    from .engines import configured

    config = configured()
    if config is None:
        return
    route(config)


def route(config) -> None:
    """Put the ssu class, serving with ``config`` (an :class:`ssu.Config`), in every entry of vLLM's
    SSU registry (what :func:`register` does once it has found a configuration)."""
    from vllm.model_executor.layers.mamba.ops import ssu_dispatch

    from .. import dropin
    from .engines import announce

    global _announce
    backend = ssu_class(ssu_dispatch, config)
    registry = ssu_dispatch._BACKEND_REGISTRY
    for key in list(registry):
        if not getattr(registry[key], "routes_to_ssu", False):
            _replaced.setdefault(key, registry[key])
        registry[key] = backend
    if _announce is None:
        _announce = announce("vLLM", logger)
        dropin.on_open.append(_announce)
    logger.info(
        "ssu routes vLLM's Mamba2 SSU dispatch (%s) to backend %s (%s)",
        ", ".join(str(getattr(k, "value", k)) for k in registry), ", ".join(config.candidates), config.source,
    )  # fmt: skip


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


def ssu_class(ssu_dispatch, config) -> type:
    """The ``MambaSSUBackend`` of ``ssu_dispatch`` (vLLM's module) whose calls ssu serves with ``config``."""
    from ..dropin import selective_state_update

    null_block = getattr(ssu_dispatch, "NULL_BLOCK_ID", 0)

    class SSUMambaBackend(ssu_dispatch.MambaSSUBackend):
        """vLLM's Mamba SSU backend interface served by ssu: each call goes to
        :func:`ssu.selective_state_update` with the engine's own arguments (vLLM's packed
        speculative form included) on vLLM's cache. vLLM's stochastic-rounding settings are not
        read: the ssu backend's own options (``[ssu.backends.<name>]``) decide."""

        routes_to_ssu = True

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
            selective_state_update(
                state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices, dst_state_batch_indices,
                out=out, null_block_id=null_block_id, num_accepted_tokens=num_accepted_tokens, cu_seqlens=cu_seqlens,
                config=config,
            )  # fmt: skip

    return SSUMambaBackend


def serving() -> Optional[type]:
    """The ssu class in vLLM's registry, where :func:`register` routed it (None otherwise)."""
    if not _replaced:
        return None
    from vllm.model_executor.layers.mamba.ops import ssu_dispatch

    return next(iter(ssu_dispatch._BACKEND_REGISTRY.values()))
