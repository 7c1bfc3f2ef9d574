"""What the engine plugins (:mod:`ssu.integrations.vllm`, :mod:`ssu.integrations.sglang`) share:
whether this process names an ssu backend, the one line each opened kernel logs, and the call
through the drop-in.

An engine plugin does something only where the serving process names a backend: ``SSU_BACKEND``,
or ``backend`` in ``ssu.toml`` / ``[tool.ssu]`` in its working directory. Without that the plugin
returns at once, importing neither the engine's modules nor any backend, and the engine behaves
exactly as without it. With it, the engine's SSU dispatch is routed through
:func:`ssu.selective_state_update` with that configuration: each problem (shapes, dtypes, pad id,
device; one process per tensor-parallel rank) opens, adopts the engine's cache and warms up its
kernel at its first call, which engines make in their warmup runs before capturing CUDA graphs,
and logs one line saying which backend serves it and why.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ..config import Config
    from ..kernel import Kernel


def configured() -> Optional["Config"]:
    """This process's ssu configuration where it names a backend (``SSU_BACKEND``, or ``backend`` in
    the ``ssu.toml`` / ``[tool.ssu]`` of the working directory); None where it names none. A
    configuration that names one and is wrong raises its :class:`~ssu.ConfigError`: a user who asked
    for ssu hears why it cannot serve, rather than the engine silently running without it."""
    from ..config import load_config

    config = load_config()
    return None if config.source == "default" else config


def announce(engine: str, logger: logging.Logger) -> "callable":
    """A listener for :data:`ssu.dropin.on_open`: logs, once per kernel the drop-in opens, which
    backend serves ``engine``'s SSU for which problem, and why (the resolution; every candidate's
    verdict at debug level)."""

    def opened(kernel: "Kernel") -> None:
        resolution = kernel.resolution
        rejected = [c for c in resolution.trace if c.outcome == "rejected"]
        why = f"requested {', '.join(resolution.requested)} ({resolution.source})"
        if rejected:
            why += "; passed over: " + "; ".join(f"{c.name}: {c.reason}" for c in rejected)
        logger.info("ssu serves %s's Mamba2 SSU with backend %r for %s: %s", engine, kernel.backend,
                    kernel.problem.describe(), why)  # fmt: skip
        logger.debug("ssu: %s", resolution.explain())

    return opened
