"""Hugging Face transformers' Mamba2-family models decoding through ssu, on the model's own cache.

    import ssu.integrations.transformers as ssu_hf
    ssu_hf.patch(model)                        # or: with ssu_hf.patch(model): model.generate(...)

After :func:`patch`, every Mamba2 mixer of ``model`` (Mamba2, NemotronH, FalconH1, Bamba,
GraniteMoeHybrid and Zamba2 in transformers 5.17 to 5.25) runs its one-token decode SSU through
:func:`ssu.selective_state_update` on the tensor transformers keeps in its cache for that layer:
the cache is stepped in place (no copy), so transformers' own prefill of a next turn, beam
reordering and everything else that reads the cache see ssu's states. Prefill (the chunked
scan), convolutions, norms and projections stay transformers' own.

How: a transformers Mamba2 mixer calls the module-level function ``mamba2_selective_state_update``
of its modeling module; :func:`patch` replaces that function, in each modeling module with a
patched mixer, by one that sends the call to ssu while a patched mixer is running and to the
original otherwise, so other models in the process are not affected; a decode call tries the
config's cache lanes (:func:`ssu.dropin.lanes_of`) itself and, where every lane declines it, goes
on with the rest of the drop-in (:func:`ssu.dropin.after_cache_lanes`): the shortest path on
the host (transformers from 5.25 passes a fresh copy of the layer's cache each step, which a cache
lane steps as it would the cache). A patched mixer's
``forward`` is wrapped (an instance attribute) to mark it running, rather than given forward
hooks, which would move every call of the mixer onto torch's slower hook path.
:meth:`Patch.undo` removes the wrappers and puts the original back when no patch uses it.
Mamba-1 architectures (mamba, falcon_mamba, jamba: an SSU with untied parameters) are refused.
"""

from __future__ import annotations

import contextvars
import sys
from typing import Any, Optional

import attrs

from ..contract.errors import ConfigError, SSUError

#: the function a transformers Mamba2 mixer calls for its decode SSU, in its modeling module
FUNCTION = "mamba2_selective_state_update"
#: what Mamba-1 mixers call instead (refused: their parameters vary along the head dimension)
MAMBA1_FUNCTION = "mamba_selective_state_update"
#: the mixer attributes the shapes are read from
SHAPE_ATTRIBUTES = ("num_heads", "head_dim", "ssm_state_size", "n_groups")
#: transformers versions these modules were tested with
TESTED = "5.17 to 5.25"


class UnsupportedModelError(SSUError, ValueError):
    """The model has no Mamba2 mixer ssu can serve (another SSU, or none)."""


#: how the patched mixer running now is served (a :class:`Serving`; None: not a patched mixer)
_running: contextvars.ContextVar = contextvars.ContextVar("ssu_transformers_mixer", default=None)


@attrs.frozen
class Serving:
    """How a patch serves its mixers: the config, and the 8-bit dtype whose contents the model's
    cache is rounded to after each step (None: the cache keeps what the step wrote)."""

    config: Any
    state_rounding: Optional[str] = None
    #: the key of the config's cache lanes in :func:`ssu.dropin.lanes_of`'s table
    lanes: tuple = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        from ..dropin.cache import lanes_of

        object.__setattr__(self, "lanes", lanes_of(self.config)[1])


#: modeling module name -> [original function, number of patches using it]
_patched_modules: dict = {}


@attrs.define(eq=False)
class Patch:
    """What :func:`patch` did to one model: undo it with :meth:`undo` (or leave the ``with``)."""

    model: Any = attrs.field(repr=False)
    mixers: list = attrs.field(repr=False)
    modules: list
    config: Any = attrs.field(repr=False)
    active: bool = True
    state_rounding: Optional[str] = None

    def __repr__(self) -> str:
        backend = ", ".join(self.config.candidates) if hasattr(self.config, "candidates") else self.config
        state = "active" if self.active else "undone"
        rounding = f", state rounding {self.state_rounding}" if self.state_rounding else ""
        return (
            f"<ssu.integrations.transformers.Patch of {type(self.model).__name__}: {len(self.mixers)} mixer(s), "
            f"backend {backend}{rounding}, {state}>"
        )

    @property
    def serving(self) -> Serving:
        """What a patched mixer runs with (set while it runs)."""
        return Serving(self.config, self.state_rounding)

    def undo(self) -> None:
        """Remove the mixers' forward wrappers; restore each modeling module's function once no
        patch uses it."""
        if not self.active:
            return
        for mixer in self.mixers:
            if getattr(mixer.__dict__.get("forward"), "_ssu_marks", False):
                del mixer.forward
        for name in self.modules:
            entry = _patched_modules[name]
            entry[1] -= 1
            if entry[1] == 0:
                setattr(sys.modules[name], FUNCTION, entry[0])
                del _patched_modules[name]
        self.active = False
        if getattr(self.model, "_ssu_patch", None) is self:
            del self.model._ssu_patch

    def __enter__(self) -> "Patch":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()


def find_mixers(model) -> list:
    """The Mamba2 mixers of ``model``: modules whose modeling module defines the decode SSU
    function and that carry the mixer's shapes. Raises :class:`UnsupportedModelError` for a
    Mamba-1 model or a model without mixers."""
    mixers, mamba1 = [], []
    for name, module in model.named_modules():
        defining = sys.modules.get(type(module).__module__)
        if defining is None or not hasattr(module, "A_log"):
            continue
        if hasattr(defining, FUNCTION) and all(hasattr(module, a) for a in SHAPE_ATTRIBUTES):
            mixers.append((name, module))
        elif hasattr(defining, MAMBA1_FUNCTION):
            mamba1.append(type(module).__name__)
    if mamba1 and not mixers:
        raise UnsupportedModelError(
            f"{type(model).__name__} has Mamba-1 mixers ({', '.join(sorted(set(mamba1)))}): their SSU takes parameters "
            "that vary along the head dimension, which ssu does not serve; ssu patches Mamba2-family models (Mamba2, "
            "NemotronH, FalconH1, Bamba, GraniteMoeHybrid, Zamba2)"
        )
    if not mixers:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no Mamba2 mixer (no module calling {FUNCTION}); "
            "ssu patches Mamba2-family models (Mamba2, NemotronH, FalconH1, Bamba, "
            "GraniteMoeHybrid, Zamba2)"
        )
    return mixers


def _mixer_problem(mixer, device, dtype):
    from ..contract.problem import Problem

    return Problem(
        nheads=mixer.num_heads,
        headdim=mixer.head_dim,
        dstate=mixer.ssm_state_size,
        ngroups=mixer.n_groups,
        state_dtype="fp32",
        input_dtype=dtype,
        num_slots=1,
        max_batch=1,
        device=str(device),
        engine_state=True,
    )


def _check_served(mixers, config) -> None:
    """Every distinct mixer shape resolves to a backend (the model's cache is fp32, its inputs in
    the model's dtype), or the reason is raised before anything is patched."""
    from ..plugins.registry import default_registry
    from ..plugins.resolve import resolve

    seen = set()
    for name, mixer in mixers:
        weight = mixer.A_log
        dtype = mixer.dt_bias.dtype if mixer.dt_bias.dtype != weight.dtype else weight.dtype
        problem = _mixer_problem(mixer, weight.device, _input_dtype(mixer, dtype))
        if problem in seen:
            continue
        seen.add(problem)
        try:
            resolve(config, problem, default_registry(), in_place=True)
        except SSUError as exc:
            raise ConfigError(f"mixer {name} ({problem.describe()}) cannot be served: {exc}") from None


def _input_dtype(mixer, fallback):
    """The dtype the mixer's activations reach the SSU in: its in_proj's weight dtype."""
    proj = getattr(mixer, "in_proj", None)
    return proj.weight.dtype if proj is not None and hasattr(proj, "weight") else fallback


def patch(model, config=None, *, state_rounding: Optional[str] = None, **options) -> Patch:
    """Route the decode SSU of every Mamba2 mixer of ``model`` through ssu (see the module doc).

    ``config`` is an :class:`ssu.Config` (default: :func:`ssu.load_config`); ``options`` are its
    fields instead (``backend="triton"``, ``validate=False``, ``backends={...}``). Returns a
    :class:`Patch`, also a context manager. Raises, leaving the model as it was, for a model
    without Mamba2 mixers (:class:`UnsupportedModelError`), a model patched already, or mixer
    shapes or dtypes no configured backend serves (:class:`ssu.ConfigError` with the reason).

    ``state_rounding`` (``"int8"`` or ``"fp8_e4m3"``): after each decode step the layer's cache is
    rounded in place to what an 8-bit cache of that dtype would hold (row scales computed afresh,
    :mod:`ssu.state.quant`), so that generation shows the accuracy of such a cache on a model whose
    cache transformers keeps in fp32 (the time per token then includes the rounding).
    """
    from ..plugins.config import Config, load_config
    from ..dropin import selective_state_update
    from ..dropin.cache import after_cache_lanes

    if getattr(model, "_ssu_patch", None) is not None:
        raise ConfigError(
            f"{type(model).__name__} is patched already; call .undo() on its patch (model._ssu_patch) "
            "before patching it again"
        )
    if config is not None and options:
        raise ConfigError("patch: give a config or its fields as keyword arguments, not both")
    if config is None:
        config = Config(**options) if options else load_config()
    if state_rounding is not None:
        from ..contract.dtypes import QUANTIZED_STATE_DTYPES, dtype_in

        state_rounding = dtype_in(
            state_rounding, QUANTIZED_STATE_DTYPES, what="state_rounding", kind="an 8-bit state dtype"
        )
    mixers = find_mixers(model)
    _check_served(mixers, config)
    modules = sorted({type(m).__module__ for _, m in mixers})
    result = Patch(model, [m for _, m in mixers], modules, config, state_rounding=state_rounding)
    for name in modules:
        module = sys.modules[name]
        if name not in _patched_modules:
            original = getattr(module, FUNCTION)
            _patched_modules[name] = [original, 0]
            setattr(module, FUNCTION, _dispatcher(original, selective_state_update, after_cache_lanes))
        _patched_modules[name][1] += 1
    for mixer in result.mixers:
        mixer.forward = _marking(mixer.forward, result.serving)
    model._ssu_patch = result
    return result


def _marking(forward, serving: Serving):
    """``forward`` (a mixer's bound method) run with the mixer marked as a patched one served as
    ``serving`` says: the instance attribute that stands for it while patched."""

    def marked_forward(*args, **kwargs):
        token = _running.set(serving)
        try:
            return forward(*args, **kwargs)
        finally:
            _running.reset(token)

    marked_forward._ssu_marks = True
    marked_forward.__wrapped__ = forward
    return marked_forward


def _dispatcher(original, selective_state_update, after_cache_lanes):
    """The modeling module's new function: ssu while a patched mixer runs, else the original. Under
    ``torch.compile`` the call to ssu is a graph break: it runs as it does eagerly (its kernel
    lookups and checks are Python), the rest of the model compiled around it; eagerly it is a
    plain call (no dynamo wrapper in the way)."""
    import torch

    from ..dropin.cache import lanes_of
    from ..state.quant import stored

    compiled_out = torch.compiler.disable(selective_state_update)
    is_compiling = torch.compiler.is_compiling
    lanes = lanes_of()[0]

    def mamba2_selective_state_update(
        state, hidden_states, dt, A, B, C, D=None, dt_bias=None, dt_softplus=False, z=None, **kwargs
    ):
        serving = _running.get()
        if serving is None:
            return original(
                state, hidden_states, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=dt_softplus, z=z, **kwargs
            )
        if is_compiling():
            out = compiled_out(state, hidden_states, dt, A, B, C, D, z, dt_bias, dt_softplus, config=serving.config)
        else:
            # the drop-in's own first move for a plain call, made here (one Python call less), then
            # the rest of the drop-in where every lane declines
            for lane in lanes.get(serving.lanes, ()):
                out = lane(state, hidden_states, dt, A, B, C, D, z, dt_bias, dt_softplus)
                if out is not None:
                    break
            else:
                out = after_cache_lanes(
                    state, hidden_states, dt, A, B, C, D, z, dt_bias, dt_softplus, config=serving.config
                )
        if serving.state_rounding is not None:  # what an 8-bit cache would hold now
            state.copy_(stored(state, serving.state_rounding))
        return out

    mamba2_selective_state_update.__wrapped__ = original
    return mamba2_selective_state_update


def patched(model) -> Optional[Patch]:
    """The active :class:`Patch` of ``model``, or None."""
    return getattr(model, "_ssu_patch", None)
