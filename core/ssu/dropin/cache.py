"""The drop-in's kernels and adopted caches: one kernel per problem (opened through the configured
backend and warmed up at its first call), each engine tensor adopted once, the lanes a call without
slot ids or ``out`` takes, and what a call checks before it reaches ``kernel.step``. Shared by
mamba_ssm's call (:mod:`ssu.dropin.mamba`) and the engines' call forms (:mod:`ssu.dropin.engines`).
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING, Any, Optional

import attrs

from ..contract.errors import BackendUnavailableError, InputError, NotServedError, counted

if TYPE_CHECKING:
    from torch import Tensor

    from ..plugins.config import Config
    from ..runtime.kernel import Kernel
    from ..contract.records import State


@attrs.define(eq=False)
class _Adopted:
    """One engine tensor adopted by one kernel, with what a call checks and passes on at hand."""

    tensor: "weakref.ref[Tensor]"
    kernel: "Kernel"
    state: "State"
    step: Any = None  # kernel.step
    max_batch: int = 0
    pad_slot_id: int = -1
    #: the kernel's lanes (``Kernel.lane``) for the layouts of recent calls without slot ids or out,
    #: most recent first
    lanes: list = attrs.Factory(list)
    #: lanes asked for so far; none is asked for beyond :data:`LANE_BINDS`
    binds: int = 0
    #: whether a call on this tensor was told of rows served as padding (:func:`_warn_padded`)
    warned: bool = False
    num_slots: int = 0
    #: whether the kernel's fault record is read for free (on the CPU) after each call with slot ids
    host: bool = False

    def __attrs_post_init__(self) -> None:
        self.step = self.kernel.step
        self.max_batch = self.kernel.problem.max_batch
        self.pad_slot_id = self.kernel.problem.pad_slot_id
        self.num_slots = self.kernel.problem.num_slots
        self.host = self.kernel.problem.device == "cpu"


_configs: dict = {}  # id(config) -> the Config used (None: the loaded one)
_kernels: dict = {}  # (problem fields but the batch, id(config)) -> Kernel
_adopted: dict = {}  # (id(state), id(config)[, engine call form]) -> _Adopted
#: (problem fields but the batch, id(config), batch bucket, tokens) -> why no configured backend
#: serves that problem: its next tensor is refused without resolving again
_declined: dict = {}
_rows: dict = {}  # (batch, device string) -> arange(batch): the slots of a call without state_batch_indices
#: (id(config), pad_slot_id) -> the kernels' cache lanes (``Kernel.cache_lane``), most recent first:
#: each serves any tensor of its layout, adopted or not (a copy a model makes of its cache per step)
_lanes: dict = {}
_lane_owners: dict = {}  # the same keys -> [(kernel, layout of the tensors it steps)], as _lanes orders them
_cache_binds: dict = {}  # the same keys -> cache lanes bound so far
#: called with each kernel the drop-in opens, once it is warmed up (an engine plugin logs which
#: backend serves it); never on the hot path
on_open: list = []


def clear() -> None:
    """Forget every kernel, adopted cache and loaded config (after changing ``ssu.toml`` or
    ``SSU_BACKEND``, or to free what the kernels hold)."""
    _configs.clear()
    _kernels.clear()
    _adopted.clear()
    _declined.clear()
    _rows.clear()
    _lanes.clear()
    _lane_owners.clear()
    _cache_binds.clear()


def after_cache_lanes(
    state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None,
    dst_state_batch_indices=None, pad_slot_id: int = -1, out=None, *, config: Optional["Config"] = None,
) -> "Tensor":  # fmt: skip
    """:func:`selective_state_update` from the point where the config's cache lanes (the tables of
    :func:`lanes_of`) have been tried and declined the call, or do not apply to it (slot ids or
    ``out`` given): for a caller that tries those lanes itself (the transformers patch), so that
    a call every lane declines does not try them twice. The arguments are
    :func:`selective_state_update`'s."""
    ids = state_batch_indices is not None or dst_state_batch_indices is not None
    plain = not ids and out is None
    entry = _adopted.get((id(state), id(config)))
    b = x.shape[0]
    fresh = entry is None or entry.tensor() is not state or b > entry.max_batch or entry.pad_slot_id != pad_slot_id
    if fresh:
        entry = _prepare(state, x, B, pad_slot_id, config, params=(dt, A, D, dt_bias))
    if plain:
        for lane in entry.lanes:
            y = lane(x, dt, A, B, C, D, z, dt_bias, dt_softplus)
            if y is not None:
                return y
    if state_batch_indices is None:
        state_batch_indices = _rows.get((b, entry.kernel.problem.device))
        if state_batch_indices is None:
            state_batch_indices = _default_rows(b, entry, pad_slot_id)
        if b > entry.num_slots and not entry.warned:  # rows past the cache: known on the host
            _warn_padded(
                entry,
                b - entry.num_slots,
                b,
                f"without state_batch_indices row b uses slot b, and the cache has {counted(entry.num_slots, 'slot')}, "
                f"none for rows {entry.num_slots}..{b - 1}",
                f"Pass state_batch_indices, or a cache of {b} slots or more",
                stacklevel=4,
            )
    y = entry.step(
        entry.state, x, dt, A, B, C, state_batch_indices, D, z, dt_bias, dt_softplus, out, 0, dst_state_batch_indices
    )
    if ids and not entry.warned and (entry.host or fresh):
        _warn_ids_outside(entry, state_batch_indices, dst_state_batch_indices)
    if plain and entry.binds < LANE_BINDS:
        _bind_lane(entry, (id(config), pad_slot_id), x, dt, A, B, C, state_batch_indices, D, z, dt_bias, dt_softplus)
    return y


def not_a_tensor(**named) -> InputError:
    """The error of a call whose first argument of ``named`` that is no tensor is read as one."""
    import torch

    dims = {"x": " (batch, H, P), or (batch, T, H, P) for SGLang's verify call"}
    for name, value in named.items():
        if value is not None or name == "x":
            if not isinstance(value, torch.Tensor):
                return InputError(f"{name}: expected a torch.Tensor{dims.get(name, '')}, got {type(value).__name__}")
    return InputError("x, state_batch_indices, dst_state_batch_indices: expected torch.Tensors")


def _warn_padded(entry: _Adopted, count: int, batch: int, why: str, remedy: str, stacklevel: int) -> None:
    """Say once per cache tensor that ``count`` of a call's ``batch`` rows were served as pad rows
    (docs/spec.md, "Pad rows, and ids that name no slot"), ``why``, and where the caller, who holds
    no kernel, sees them."""
    import warnings

    from ..contract.errors import SSUWarning

    entry.warned = True
    warnings.warn(
        f"ssu.selective_state_update served {counted(count, 'row')} of a call's {batch} as pad rows (a zero state "
        f"read, no state written, the output written): {why}; said once per cache. {remedy}; "
        "ssu.dropin.kernel_for(cache).check() raises naming the first such row since it last checked (it reads "
        'the kernel\'s fault record: on CUDA a synchronisation), and validate = "full" refuses such ids before '
        "the step",
        SSUWarning,
        stacklevel=stacklevel,
    )


def _warn_ids_outside(entry: _Adopted, slots, dst_slots) -> None:
    """:func:`_warn_padded` for a call whose slot ids (or destinations) name no slot of the cache.

    The kernel's fault record (:mod:`ssu.state.faults`) says whether any call met such an id; it
    lives on the cache's device, and reading it from a CUDA device synchronises the host. So it is
    read after every call on a CPU cache (where reading is free), but on CUDA only after a
    tensor's first call, the slow path that adopts it (never while a CUDA graph is captured): a
    later call's ids outside a CUDA cache are served as pad rows, recorded, and reported by
    ``ssu.dropin.kernel_for(cache).check()``, and ``validate = "full"`` refuses them. Where the
    record holds a fault, this call's ids are counted (the record keeps only the first row of
    all calls since the last check), and a record set by another tensor's call says nothing here."""
    import torch

    from ..state import faults

    if not entry.host and torch.cuda.is_current_stream_capturing():
        return
    if int(entry.kernel._ctx.faults.item()) == faults.NO_FAULT:
        return
    bad = {}
    for name, ids in (("state_batch_indices", slots), ("dst_state_batch_indices", dst_slots)):
        if ids is not None:
            bad[name] = faults.outside(ids, entry.num_slots, entry.pad_slot_id)
    rows = torch.stack(list(bad.values())).any(0)
    count = int(rows.sum())
    if not count:
        return
    name, mask = next((n, m) for n, m in bad.items() if bool(m.any()))
    row = int(mask.nonzero()[0, 0])
    value = int((slots if name == "state_batch_indices" else dst_slots)[row])
    _warn_padded(
        entry,
        count,
        rows.shape[0],
        f"their ids name no slot of the cache (slots 0..{entry.num_slots - 1}) nor the pad id {entry.pad_slot_id}, "
        f"the first: {name}[{row}] = {value}",
        "Fix the caller's slot ids",
        stacklevel=5,
    )


#: lanes asked of a kernel per adopted tensor, at most (a layout its lanes keep declining, such as
#: unaligned inputs, stops being asked for one), and lanes kept per adopted tensor or per config
LANE_BINDS, LANES = 16, 4


def _bind_lane(entry: _Adopted, key: tuple, *call) -> None:
    """Ask the kernel for a lane for the layout of the call just stepped and keep it first: a cache
    lane (``Kernel.cache_lane``), which serves every tensor of the adopted one's layout, among the
    lanes of ``key`` (the config and pad id; :data:`LANE_BINDS` binds per key at most); else a lane
    of this tensor (``Kernel.lane``). A kernel with neither is not asked again for this tensor."""
    entry.binds += 1
    if _cache_binds.get(key, 0) < LANE_BINDS:
        lane = entry.kernel.cache_lane(entry.state, *call)
        if lane is not None:
            _cache_binds[key] = _cache_binds.get(key, 0) + 1
            lanes, owners = _lanes.setdefault(key, []), _lane_owners.setdefault(key, [])
            lanes.insert(0, lane)
            owners.insert(0, (entry.kernel, _layout(entry.state.cache[0])))
            del lanes[LANES:], owners[LANES:]
            return
    lane = entry.kernel.lane(entry.state, *call)
    if lane is None:
        if not entry.lanes:
            entry.binds = LANE_BINDS
        return
    entry.lanes.insert(0, lane)
    del entry.lanes[LANES:]


def lanes_of(config: Optional["Config"] = None, pad_slot_id: int = -1) -> tuple:
    """``(table, key)``: the cache lanes of ``config``'s plain calls with ``pad_slot_id`` are
    ``table.get(key, ())``, most recent first, each ``lane(state, x, dt, A, B, C, D, z, dt_bias,
    dt_softplus)`` returning the output or None for a call it declines. For a caller that makes
    the drop-in's plain calls itself (the transformers patch) and tries them before the call: the
    table is the same object for the life of the process (:func:`clear` empties it), so it is
    looked up per call and never held stale."""
    return _lanes, (id(config), pad_slot_id)


def _layout(t) -> tuple:
    """What a cache lane compares of the tensor it steps, as :func:`kernel_for` compares it."""
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _default_rows(b: int, entry: _Adopted, pad_slot_id: int):
    """``arange(b)`` on the kernel's device (row b uses slot b), kept for the next call."""
    import torch

    if 0 <= pad_slot_id < b:
        raise InputError(
            f"pad_slot_id={pad_slot_id} is the slot of row {pad_slot_id} (without state_batch_indices "
            "row b uses slot b); pass state_batch_indices, or a pad id outside 0.."
            f"{b - 1} (the default -1)"
        )
    device = entry.kernel.problem.device
    rows = _rows[(b, device)] = torch.arange(b, dtype=torch.int32, device=device)
    return rows


def _config(config):
    from ..plugins.config import Config, load_config

    key = id(config)
    if key not in _configs:
        if config is not None and not isinstance(config, Config):
            raise InputError(f"config: expected an ssu.Config (see ssu.load_config), got {type(config).__name__}")
        _configs[key] = load_config() if config is None else config
    return _configs[key]


def batch_bucket(batch: int) -> int:
    """The batch a kernel for ``batch`` sequences is opened for: the next power of two, so that a
    growing batch opens a kernel per bucket, and a problem no backend serves is one per bucket."""
    return 1 << (max(batch, 1) - 1).bit_length()


#: the shapes a drop-in call's state, x and B have, per call form
_DIMS = {
    "step": ("(batch, H, P)", "(batch, G, N)", "one token per sequence"),
    "packed": ("(tokens, H, P)", "(tokens, G, N)", "the tokens of every sequence, packed"),
    "verify": ("(batch, T, H, P)", "(batch, T, G, N)", "T tokens per sequence"),
}


def _prepare(
    state, x, B, pad_slot_id: int, config, form: str = "step", tokens: int = 1, batch=None, params=None
) -> _Adopted:
    """The slow path: the problem of this call, its kernel (opened and warmed up once), and
    ``state`` adopted by it. ``form``: the call form (``"step"``; ``"packed"``, ``"verify"`` or
    ``"tree"`` for the engines' calls, :mod:`ssu.dropin.engines`), ``tokens`` the most tokens a
    sequence of it carries, ``batch`` its sequences (default: x's first dimension), ``params`` the
    call's ``(dt, A, D, dt_bias)``.

    A call ssu does not serve raises before anything is written: :class:`~ssu.NotServedError` for
    a Mamba-1 layer's shapes or parameters, :class:`~ssu.BackendUnavailableError` for a problem no
    configured backend serves (remembered: the next tensor of that problem is refused at once)."""
    import torch

    from ..runtime.kernel import open_kernel

    x_dims, B_dims, what = _DIMS["verify" if form == "tree" else form]
    for name, t, dims in (("state", state, "(num_slots, H, P, N)"), ("x", x, x_dims), ("B", B, B_dims)):
        if not isinstance(t, torch.Tensor) or t.dim() != len(dims.split(",")):
            got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            error = NotServedError if isinstance(t, torch.Tensor) else InputError
            raise error(
                f"{name}: expected a tensor {dims} ({what}; a Mamba-1 layer's (batch, dim) inputs are not served), "
                f"got {got}"
            )
    if params is not None:
        _refuse_untied(state, x, *params)
    if isinstance(pad_slot_id, bool) or not isinstance(pad_slot_id, int):
        raise InputError(f"pad_slot_id: expected an integer, got {pad_slot_id!r}")
    from ..contract.dtypes import QUANTIZED_STATE_DTYPES

    quantized = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3"}.get(state.dtype)
    if quantized in QUANTIZED_STATE_DTYPES:
        raise InputError(
            f"state: an {quantized} cache keeps a row scale per (slot, head, row) beside it, which this call "
            "does not take; open a kernel with ssu.open and adopt both with kernel.adopt_state(cache, scales=...)"
        )
    S, H, P, N = state.shape
    b = x.shape[0] if batch is None else batch
    used = _config(config)
    fields = dict(
        nheads=H,
        headdim=P,
        dstate=N,
        ngroups=B.shape[-2],
        state_dtype=state.dtype,
        input_dtype=x.dtype,
        num_slots=S,
        device=str(state.device),
        pad_slot_id=pad_slot_id,
        engine_state=True,
        engine_calls=frozenset() if form == "step" else frozenset({form}),
    )
    key = (tuple(sorted((k, str(sorted(v) if isinstance(v, frozenset) else v)) for k, v in fields.items())), id(config))
    kernel = _kernels.get(key)
    if kernel is None or b > kernel.problem.max_batch or tokens > kernel.problem.tokens_per_step:
        batch = max(b, 1 if kernel is None else kernel.problem.max_batch)
        T = max(tokens, 1 if kernel is None else kernel.problem.tokens_per_step)
        bucket = batch_bucket(batch)
        declined = (key, bucket, T)
        if declined in _declined:  # a copy: raising one object again would lengthen its traceback
            raise copy.copy(_declined[declined])
        try:
            kernel = open_kernel(used, _problem(dict(fields, tokens_per_step=T), bucket), in_place=True)
        except BackendUnavailableError as exc:
            _declined[declined] = exc
            raise
        _kernels[key] = kernel
        warm = True
    else:
        warm = False
    # the adopted state holds an alias of the engine's tensor (its storage, not the tensor object,
    # which a view would keep alive through ``_base``), so that the engine dropping its tensor
    # drops this entry, and the memory, too
    alias = state.new_empty(0).set_(state.untyped_storage(), state.storage_offset(), state.size(), state.stride())
    adopted = kernel.adopt_state(alias)
    if warm:
        kernel.warmup(adopted)
        for listener in on_open:
            listener(kernel)
    key = (id(state), id(config)) if form == "step" else (id(state), id(config), form)
    entry = _Adopted(weakref.ref(state, lambda _, key=key: _adopted.pop(key, None)), kernel, adopted)
    before = _adopted.get(key)
    entry.warned = before is not None and before.tensor() is state and before.warned  # once per tensor
    _adopted[key] = entry
    return entry


#: the argument of the drop-in call that each Problem field is read from
_ARGUMENT_OF = {
    "state_dtype": "state",
    "input_dtype": "x",
    "nheads": "state",
    "headdim": "state",
    "dstate": "state",
    "ngroups": "B",
    "num_slots": "state",
    "tokens_per_step": "state_batch_indices",
}


def _refuse_untied(state, x, dt, A, D, dt_bias) -> None:
    """Raise :class:`~ssu.NotServedError` where a per-head parameter varies along P or N: a
    Mamba-1 layer's A (dim, N), passed as (H, P, N) with its own value per row or column, or its D,
    dt_bias and dt per channel. Mamba2 passes them per head or expanded with stride 0."""
    import torch

    P = state.shape[2]
    expanded = (
        ("A", A, 1),
        ("D", D, 1),
        ("dt_bias", dt_bias, 1),
        ("dt", dt, x.dim() - 1 if isinstance(x, torch.Tensor) else 0),
    )
    for name, t, lead in expanded:
        if not isinstance(t, torch.Tensor) or t.dim() <= lead or (name == "dt" and t.dim() != x.dim()):
            continue
        along = tuple(st for st, size in zip(t.stride()[lead:], t.shape[lead:]) if size > 1)
        if name != "A" and t.shape[-1] != P:
            continue
        if any(along):
            raise NotServedError(
                f"{name}: varies along its last {t.dim() - lead} dimension(s) (shape {tuple(t.shape)}, strides "
                f"{tuple(t.stride())}): ssu serves Mamba2's per-head {name}, or its expansion with stride 0; a "
                "Mamba-1 layer's untied parameters are not served"
            )


def _problem(fields: dict, max_batch: int):
    """The Problem of a drop-in call; a field it refuses is an :class:`InputError` naming the
    call's argument it came from (the caller built no Problem)."""
    from ..contract.errors import ConfigError
    from ..contract.problem import Problem

    try:
        return Problem(**fields, max_batch=max_batch)
    except ConfigError as exc:
        message = str(exc)
        named = sorted({arg for field, arg in _ARGUMENT_OF.items() if field in message})
        where = " and ".join(named) or "the call"
        dims = " (state is (num_slots, H, P, N), B is (batch, G, N))" if "ngroups" in message else ""
        detail = message.split(": ", 1)[1] if message.startswith("Problem") and ": " in message else message
        raise InputError(f"{where}: {detail}{dims}") from None


def kernel_for(state: "Tensor", config: Optional["Config"] = None) -> Optional["Kernel"]:
    """The kernel that serves ``state`` (after a first call), for ``explain()`` or ``check()``: the
    one that adopted it, else the one whose cache lane serves tensors of its layout."""
    entry = _adopted.get((id(state), id(config)))
    if entry is not None and entry.tensor() is state:
        return entry.kernel
    layout = _layout(state)
    for (config_id, _), owners in _lane_owners.items():
        for kernel, served in owners:
            if config_id == id(config) and served == layout:
                return kernel
    return None


def served(state: "Tensor", config: Optional["Config"] = None) -> Optional[tuple]:
    """``(kernel, State)`` stepping ``state`` as its calls do (after a first call), for timing the
    backend's step callable on it: the State the kernel adopted it as, or, for a tensor the
    kernel's cache lanes serve without adopting it, a State adopted now. None if no kernel serves it."""
    kernel = kernel_for(state, config)
    if kernel is None:
        return None
    entry = _adopted.get((id(state), id(config)))
    return kernel, entry.state if entry is not None and entry.tensor() is state else kernel.adopt_state(state)
