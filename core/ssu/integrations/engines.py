"""What the engine plugins (:mod:`ssu.integrations.vllm`, :mod:`ssu.integrations.sglang`) share:
whether this process names an ssu backend (checked at once), the line each opened kernel logs, and
the calls passed to the engine's own SSU.

An engine plugin does something only where the serving process names a backend: ``SSU_BACKEND``,
or ``backend`` in ``ssu.toml`` / ``[tool.ssu]`` in its working directory. Without that the plugin
returns at once, importing neither the engine's modules nor any backend, and the engine behaves
exactly as without it. With it, the configuration is checked where the engine loads the plugin
(:func:`configured`: a wrong name or option stops the engine before it serves), and the engine's
SSU dispatch is routed through :func:`ssu.selective_state_update` with that configuration: each
problem (shapes, dtypes, pad id, device; one process per tensor-parallel rank) opens, adopts the
engine's cache and warms up its kernel at its first call, which engines make in their warmup runs
before capturing CUDA graphs, and logs one line saying which backend serves it and why.

A call that ssu does not serve (a Mamba-1 layer's, which shares the engine's dispatch; a problem
no configured backend accepts) goes to the engine's own SSU backend, the one the plugin took the
place of, with the same arguments: :class:`Passed` remembers it per problem (a Mamba-1 layer's
cache and call form; else the cache, form, batch bucket and tokens that no backend serves, the
calls of other sizes staying with ssu), and logs once per problem why.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Optional

from ..contract.errors import BackendUnavailableError, NotServedError
from ..dropin.engines import call_size

if TYPE_CHECKING:
    from ..plugins.config import Config
    from ..runtime.kernel import Kernel


def configured() -> Optional["Config"]:
    """This process's ssu configuration where it names a backend (``SSU_BACKEND``, or ``backend`` in
    the ``ssu.toml`` / ``[tool.ssu]`` of the working directory); None where it names none.

    A configuration that names one is checked now (:func:`ssu.plugins.preflight.preflight` for an engine):
    an unknown or uninstalled backend name, a broken or disabled backend, a backend that cannot step
    an engine's cache, or a bad option raises its :class:`~ssu.SSUError`, whose message says where
    the name came from and what to do. A user who asked for ssu hears at startup why it cannot
    serve, rather than the engine running without it or failing at its first request."""
    from ..plugins.config import load_config
    from ..plugins.preflight import preflight

    config = load_config()
    if config.source == "default":
        return None
    preflight(config, engine=True)
    return config


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


#: the errors by which the drop-in says, before writing anything, that it does not serve a call: a
#: Mamba-1 layer's (:class:`~ssu.NotServedError`), or a problem that no configured backend serves
#: (:class:`~ssu.BackendUnavailableError`)
NOT_SERVED = (NotServedError, BackendUnavailableError)


class Passed:
    """The calls an engine plugin passes to the engine's own SSU backend, per problem: for a cache
    tensor and call form (:func:`ssu.dropin.engines.call_form`), every call where the drop-in
    refused the layer itself (:class:`~ssu.NotServedError`: a Mamba-1 layer's shapes or parameters,
    whatever the batch), else the calls of each batch bucket and token count
    (:func:`ssu.dropin.engines.call_size`) for which no configured backend serves the problem
    (:class:`~ssu.BackendUnavailableError`). The calls of that cache and form of other sizes stay
    with ssu: a new batch bucket that no backend serves does not take the calls ssu served before.

    Empty (false) while ssu serves every call, so that a plugin's hot path asks it nothing more
    than its truth; a cache tensor that the engine drops leaves it."""

    def __init__(self, engine: str, logger: logging.Logger) -> None:
        self.engine = engine
        self.logger = logger
        #: (id(state), form) -> [weakref of state, the call sizes passed on (None: every call)]
        self._tensors: dict = {}
        self._said: set = set()

    def __bool__(self) -> bool:
        return bool(self._tensors)

    def passes(self, state: Any, form: str, x: Any, slots: Any = None, cu_seqlens: Any = None) -> bool:
        """Whether this call of ``form`` on ``state`` (x, its slot ids, vLLM's ``cu_seqlens``) goes
        to the engine's SSU: one dictionary lookup, and the call's size read from its shapes only
        for a cache and form with a problem passed on."""
        entry = self._tensors.get((id(state), form))
        if entry is None or entry[0]() is not state:
            return False
        sizes = entry[1]
        return sizes is None or call_size(form, x, slots, cu_seqlens) in sizes

    def add(
        self, state: Any, x: Any, form: str, error: Exception, own: str, slots: Any = None, cu_seqlens: Any = None
    ) -> None:
        """Pass the calls of ``form`` on ``state`` of this call's problem (every call of the layer,
        for :class:`~ssu.NotServedError`) to the engine's backend ``own`` from now on, because of
        ``error``; logged once per problem (cache shape and dtype, call form, batch bucket and
        tokens, reason), whichever layer's cache meets it."""
        key = (id(state), form)
        tensors = self._tensors
        entry = tensors.get(key)
        if entry is None or entry[0]() is not state:
            entry = tensors[key] = [weakref.ref(state, lambda _, key=key: tensors.pop(key, None)), set()]
        size = None if isinstance(error, NotServedError) else call_size(form, x, slots, cu_seqlens)
        if size is None:
            entry[1] = None
        elif entry[1] is not None:
            entry[1].add(size)
        why = "; ".join(line.strip(" -") for line in str(error).splitlines() if line.strip())
        said = (form, tuple(state.shape[1:]), str(state.dtype), tuple(x.shape[1:]), size, why)
        if said in self._said:
            return
        self._said.add(said)
        if size is None:
            which = f"{_FORMS.get(form, form)} SSU calls"
            rest = ""
        else:
            which = f"{_FORMS.get(form, form)} SSU calls of {_sizes(form, *size)}"
            rest = " (it goes on serving the calls of other sizes)"
        self.logger.info(
            "ssu passes %s's %s on a %s cache of %s per slot (x %s per row) to %s's own %s backend%s: %s",
            self.engine, which, str(state.dtype).replace("torch.", ""), tuple(state.shape[1:]), tuple(x.shape[1:]),
            self.engine, own, rest, why,
        )  # fmt: skip


def _sizes(form: str, bucket: int, tokens: int) -> str:
    """The calls of a batch bucket and token count, as the log names them: ``batch 5 to 8``."""
    low = bucket // 2 + 1
    batch = f"batch {bucket}" if low >= bucket else f"batch {low} to {bucket}"
    return batch if form == "step" else f"{batch}, T={tokens}"


#: how the log names each call form
_FORMS = {"step": "decode", "packed": "speculative (packed)", "verify": "verify", "tree": "verify (tree)"}
