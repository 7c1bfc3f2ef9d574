"""Checking a call's tensors against the kernel's problem before anything is written.

Full checks run once per *input signature* (the shapes, dtypes and devices of the tensors, which
optional tensors are given); later calls with a signature seen before pay only for comparing it
(:class:`ssu.runtime.signatures.Signatures`). ``validate = "full"`` additionally checks slot
values and accepted counts on every call, which synchronises the host with the device (for
debugging, not serving).
"""

from __future__ import annotations

from typing import Any, Optional

from ..contract.dtypes import dtype_name
from ..contract.errors import InputError, counted
from ..contract.problem import Problem
from ..contract.records import State
from .signatures import STATIC_STRIDES

#: bytes to which a ``contiguous_rows`` backend needs x, z, B and C and their rows aligned
ROW_ALIGNMENT = 16


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class Checker:
    """Validates tensors for one kernel (problem, capabilities, backend name)."""

    def __init__(self, problem: Problem, backend: str, capabilities) -> None:
        import torch

        self.problem = problem
        self.backend = backend
        self.capabilities = capabilities
        self.index_dtypes = set(capabilities.index_dtypes)
        self.shared_commit = capabilities.layers_share_commit
        self.device = torch.device(problem.device)

    def static_strides(self) -> dict:
        """Which strides a signature holds for this kernel (:class:`Signatures`): the defaults, and
        for a backend that declares ``contiguous_rows`` every stride of x, z, B and C (their batch
        strides' alignment is checked) and all but the batch and token strides of dt."""
        if not self.capabilities.contiguous_rows:
            return dict(STATIC_STRIDES)
        lead = 2 if self.problem.multi_token else 1
        return dict(STATIC_STRIDES, x=0, z=0, B=0, C=0, dt=lead, A=0, D=0, dt_bias=0)

    # helpers -----------------------------------------------------------------------------------
    def _device_ok(self, t) -> bool:
        dev = t.device
        if dev.type != self.device.type:
            return False
        return self.device.index is None or dev.index == self.device.index

    def tensor(self, name: str, t: Any, shape: tuple, dtypes: tuple, *, what: str = "") -> None:
        """Check one tensor's type, device, shape (``None`` entries: any size) and dtype."""
        import torch

        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name}: expected a torch.Tensor{what}, got {type(t).__name__}")
        if not self._device_ok(t):
            raise InputError(
                f"{name}: expected a tensor on {self.problem.device} (the kernel's device), "
                f"got one on {t.device}; move it with .to({self.problem.device!r})"
            )
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise InputError(f"{name}: expected shape {want}{what}, got {tuple(t.shape)}")
        got = dtype_name(t.dtype)
        if got not in dtypes:
            raise InputError(f"{name}: expected dtype {' or '.join(dtypes)}, got {got}")

    def per_head(self, name: str, t: Any, shape: tuple, tied: tuple, dtypes: tuple) -> None:
        """A per-head parameter: ``shape``, or (for a backend with ``tied_inputs``) ``shape + tied``
        with stride 0 along the ``tied`` dimensions (Mamba2's expanded "tie_hdim" form)."""
        import torch

        expanded = shape + tied
        if isinstance(t, torch.Tensor) and t.dim() == len(expanded) and tuple(t.shape) == expanded:
            along = tuple(st for st, size in zip(t.stride()[len(shape) :], expanded[len(shape) :]) if size > 1)
            if any(along):
                raise InputError(
                    f"{name}: varies along its last {len(tied)} dimension(s) (strides {along}, not 0): ssu serves "
                    f"Mamba2's per-head {name}, {self._shape(shape)} or its expansion with stride 0; untied "
                    "parameters (Mamba-1 layers) are not served"
                )
            if not self.capabilities.tied_inputs:
                raise InputError(
                    f"{name}: backend {self.backend!r} takes it per head, {self._shape(shape)}; pass "
                    f"{name}[{', '.join([':'] * len(shape) + ['0'] * len(tied))}] (its expansion "
                    "over the head dimension is not served by this backend)"
                )
            self.tensor(name, t, expanded, dtypes)
            return
        self.tensor(name, t, shape, dtypes)

    @staticmethod
    def _shape(shape: tuple) -> str:
        return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"

    def state(self, state: Any, layer: Any) -> None:
        """Refuse a state that is not an ssu.State of this backend and problem, or a layer outside it."""
        if not isinstance(state, State):
            raise InputError(
                f"state: expected the ssu.State returned by kernel.allocate_state or kernel.adopt_state, "
                f"got {type(state).__name__}"
            )
        if state.backend != self.backend or state.problem != self.problem:
            raise InputError(
                f"state: it belongs to a kernel for backend {state.backend!r} and problem "
                f"{state.problem.describe()}; this kernel is {self.backend!r} for {self.problem.describe()}"
            )
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < state.num_layers:
            raise InputError(
                f"layer: expected an integer in [0, {state.num_layers}) for a state of "
                f"{state.num_layers} layer(s), got {layer!r}"
            )

    def slots(self, slots: Any, name: str = "slots", max_len: Optional[int] = None):
        """Check a slot-id tensor's type, dtype, shape and device; return its length (the batch)."""
        import torch

        if not isinstance(slots, torch.Tensor):
            raise InputError(f"{name}: expected an int32 or int64 torch.Tensor, got {type(slots).__name__}")
        self.tensor(name, slots, (None,), tuple(sorted(self.index_dtypes)))
        self.contiguous_vector(name, slots)
        b = slots.shape[0]
        limit = self.problem.max_batch if max_len is None else max_len
        if not 1 <= b <= limit:
            what = "Problem.max_batch" if max_len is None else "Problem.num_slots"
            raise InputError(f"{name}: batch of {b} rows; expected 1 to {limit} ({what})")
        return b

    @staticmethod
    def rows_match(x: Any, slots: Any) -> None:
        """A slot id per row of x: a call whose two batch sizes differ is refused naming both, not
        whichever of them is checked against the problem first."""
        import torch

        if isinstance(x, torch.Tensor) and isinstance(slots, torch.Tensor) and x.dim() and slots.dim() == 1:
            if x.shape[0] != slots.shape[0]:
                raise InputError(
                    f"slots (state_batch_indices): {counted(slots.shape[0], 'slot id')} for the "
                    f"{counted(x.shape[0], 'row')} of x; give "
                    "one slot id per row (sequence) of x, dt, B and C"
                )

    def slot_values(self, slots, *, allow_pad: bool = True, unique: bool = True, name: str = "slots") -> None:
        """Value checks (synchronise the host): range, pad ids, duplicates."""
        p = self.problem
        values = slots.tolist()
        for i, s in enumerate(values):
            if s == p.pad_slot_id:
                if allow_pad:
                    continue
                raise InputError(f"{name}[{i}] = {s}: the pad id of this problem, not a slot that holds a state")
            if not 0 <= s < p.num_slots:
                raise InputError(
                    f"{name}[{i}] = {s}: not a slot of this cache (0..{p.num_slots - 1}"
                    f"{f' or pad id {p.pad_slot_id}' if allow_pad else ''})"
                )
        real = [s for s in values if s != p.pad_slot_id]
        if unique and len(set(real)) != len(real):
            dup = sorted({s for s in real if real.count(s) > 1})
            raise InputError(f"{name}: slot(s) {dup} appear more than once; each sequence needs its own slot")

    # calls ---------------------------------------------------------------------------------------
    def step(self, call: dict) -> None:
        """Every check of one step call (``call``: the step's arguments by name)."""
        state, x, dt, A, B, C, slots = (call[n] for n in ("state", "x", "dt", "A", "B", "C", "slots"))
        D, z, dt_bias, dt_softplus, out, layer = (call[n] for n in ("D", "z", "dt_bias", "dt_softplus", "out", "layer"))
        dst_slots = call.get("dst_slots")
        p = self.problem
        self.state(state, layer)
        self.rows_match(x, slots)
        b = self.slots(slots)
        H, P, N, G = p.nheads, p.headdim, p.dstate, p.ngroups
        inp = (p.input_dtype,)
        wide = (p.input_dtype, "fp32") if p.input_dtype != "fp32" else ("fp32",)
        import torch

        if p.multi_token:
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                self.tensor("x", x, (b, None, H, P), inp, what=" (batch, tokens, heads, headdim)")
            T = x.shape[1]
            if not 1 <= T <= p.tokens_per_step:
                raise InputError(
                    f"x: {T} tokens per sequence; expected 1 to {p.tokens_per_step} (Problem.tokens_per_step)"
                )
            lead = (b, T)
        else:
            lead = (b,)
        self.tensor(
            "x",
            x,
            lead + (H, P),
            inp,
            what=" (batch, tokens, heads, headdim)" if p.multi_token else " (batch, heads, headdim)",
        )
        self.per_head("dt", dt, lead + (H,), (P,), wide)
        self.per_head("A", A, (H,), (P, N), ("fp32",))
        self.tensor("B", B, lead + (G, N), inp)
        self.tensor("C", C, lead + (G, N), inp)
        if D is not None:
            self.per_head("D", D, (H,), (P,), wide)
        if dt_bias is not None:
            self.per_head("dt_bias", dt_bias, (H,), (P,), wide)
        if z is not None:
            self.tensor("z", z, lead + (H, P), inp)
        if out is not None:
            self.tensor("out", out, lead + (H, P), inp)
            if 0 in out.stride() and out.numel() > 1:
                raise InputError("out: has a zero stride (an expanded view); give a tensor that owns its memory")
        if not isinstance(dt_softplus, bool):
            raise InputError(f"dt_softplus: expected True or False, got {dt_softplus!r}")
        if dst_slots is not None:
            self.destinations(slots, dst_slots, b)
        if self.capabilities.contiguous_rows:
            self.rows_layout(call, len(lead))
        if self.capabilities.dt_bias_as_dt and dt_bias is not None:
            self.dt_bias_dtype(dt, dt_bias)

    @staticmethod
    def contiguous_vector(name: str, t) -> None:
        """Slot ids and accepted counts are read as contiguous vectors."""
        if t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1:
            raise InputError(
                f"{name}: a strided vector (stride {t.stride(0)}); ids and counts are read as contiguous "
                f"vectors: pass {name}.contiguous()"
            )

    def rows_layout(self, call: dict, lead: int) -> None:
        """``Capabilities.contiguous_rows``: each row of x, z, B, C, dt and out contiguous (out
        entirely, for one token), x, z, B and C starting and their rows :data:`ROW_ALIGNMENT`
        bytes aligned (checked with each new signature; a later call's pointers are not), the
        per-head parameters with unit stride over the heads."""
        why = (
            f"backend {self.backend!r} reads each row contiguously (only the batch and token strides are free: "
            "a slice of a projection is fine, a transposed or every-other-element view is not)"
        )
        for name in ("x", "z", "B", "C", "out"):
            t = call[name]
            if t is None or t.numel() == 0:
                continue
            shape = t.shape[lead:]
            want = contiguous_strides(shape)
            got = t.stride()[lead:]
            if any(g != w for g, w, size in zip(got, want, shape) if size > 1):  # a dimension of one has no stride
                raise InputError(
                    f"{name}: strides {got} after the batch dimension(s), expected {want}: {why}; "
                    f"pass {name}.contiguous()"
                )
        for name in ("x", "z", "B", "C"):
            t = call[name]
            if t is None or not t.dim():
                continue
            if t.data_ptr() % ROW_ALIGNMENT or (t.stride(0) * t.element_size()) % ROW_ALIGNMENT:
                where = (
                    "starts at an address" if t.data_ptr() % ROW_ALIGNMENT else f"has rows {t.stride(0)} values apart"
                )
                raise InputError(
                    f"{name}: {where} not a multiple of {ROW_ALIGNMENT} bytes; backend {self.backend!r} loads "
                    f"{ROW_ALIGNMENT}-byte packets from each row: keep the projection's row width and the slice's "
                    f"offset multiples of {ROW_ALIGNMENT} bytes, or pass {name}.contiguous()"
                )
        out = call["out"]
        if out is not None and out.dim() and not out.is_contiguous():
            raise InputError(
                f"out: strides {tuple(out.stride())}, expected {contiguous_strides(tuple(out.shape))}: backend "
                f"{self.backend!r} writes a call's outputs as one contiguous block; give a contiguous out"
            )
        for name, dim in (("dt", lead), ("A", 0), ("D", 0), ("dt_bias", 0)):
            t = call[name]
            if t is not None and t.shape[dim] > 1 and t.stride(dim) != 1:
                raise InputError(f"{name}: head stride {t.stride(dim)}, expected 1: {why}; pass {name}.contiguous()")

    def dt_bias_dtype(self, dt, dt_bias) -> None:
        """``Capabilities.dt_bias_as_dt``: a dt_bias wider than dt is refused, not rounded."""
        if dt_bias.dtype != dt.dtype and dtype_name(dt_bias.dtype) == "fp32":
            raise InputError(
                f"dt_bias: fp32 while dt is {dtype_name(dt.dtype)}; backend {self.backend!r} reads dt_bias in dt's "
                "dtype, and rounding it would move every state. Convert it once when the weights load "
                "(dt_bias.to(dt.dtype)), pass dt in fp32, or choose a backend without this limit (reference, triton)"
            )

    def destinations(self, slots, dst_slots, b: int) -> None:
        """Check dst_slots: the capability, its shape against slots, and (full validation) its values."""
        p = self.problem
        if not self.capabilities.destination_slots:
            raise InputError(
                f"dst_slots: backend {self.backend!r} writes each row's state back to the slot it read "
                "(no destination-slot capability); drop dst_slots, or choose a backend that declares "
                "destination_slots (reference, triton, flashinfer)"
            )
        if p.speculative:
            raise InputError(
                "dst_slots: destination slots apply to one-token steps; a speculative step keeps its "
                "drafts beside the slot it read until commit. Step without dst_slots, or copy the "
                "committed state with read_state / write_state"
            )
        self.tensor(
            "dst_slots",
            dst_slots,
            (b,),
            (dtype_name(slots.dtype),),
            what=" (one destination per row, the dtype of slots)",
        )

    def commit(self, state, slots, num_accepted) -> None:
        """Check the arguments of a commit: a speculative kernel, the state, the slots, num_accepted."""
        self.state(state, 0)
        if not self.problem.speculative and not self.shared_commit:
            raise InputError(
                "commit: this kernel was opened with speculative=False, where step commits at once; "
                "open it with Problem(speculative=True, tokens_per_step=T) to verify draft tokens"
            )
        b = self.slots(slots)
        self.tensor("num_accepted", num_accepted, (b,), ("int32", "int64"))
        self.contiguous_vector("num_accepted", num_accepted)

    def stepped(self, state) -> None:
        """A commit needs every layer of the group stepped since the last one: the others' drafts
        would replace their committed states."""
        missing = sorted(set(range(state.num_layers)) - state.stepped)
        if missing:
            done = sorted(state.stepped)
            raise InputError(
                f"commit: layer(s) {missing} of this state were not stepped since the last commit "
                f"(stepped: {done or 'none'}); a commit moves every layer of the group, so step each "
                "layer once with these slots first. Nothing was committed"
            )

    def accepted_values(self, num_accepted) -> None:
        """Refuse a num_accepted entry outside 1..T (the first token of a row is always kept)."""
        T = self.problem.tokens_per_step
        bad = [(i, n) for i, n in enumerate(num_accepted.tolist()) if not 1 <= n <= T]
        if bad:
            i, n = bad[0]
            raise InputError(f"num_accepted[{i}] = {n}: expected 1 to {T} (at least the first token is always kept)")

    def read(self, state, slots, layer) -> None:
        """Check the arguments of read_state: the state, the layer and slot ids that name real slots."""
        self.state(state, layer)
        self.slots(slots, max_len=self.problem.num_slots)
        self.slot_values(slots, allow_pad=False, unique=False)

    def write(self, state, slots, values, layer) -> None:
        """Check the arguments of write_state: unique real slots and values of shape (b, H, P, N)."""
        p = self.problem
        self.state(state, layer)
        b = self.slots(slots, max_len=p.num_slots)
        self.slot_values(slots, allow_pad=False, unique=True)
        self.tensor("values", values, (b, p.nheads, p.headdim, p.dstate), ("fp32", "bf16", "fp16", "fp64"))

    def cache(self, cache) -> tuple:
        """The engine's tensor of each layer of an adopted cache, checked: shape (num_slots, H, P,
        N), the state dtype, the kernel's device, a contiguous (H, P, N) block per slot, slots that
        do not overlap. Accepts one tensor (one layer), an (L, num_slots, H, P, N) tensor, or a
        sequence of per-layer tensors."""

        p = self.problem
        H, P, N = p.nheads, p.headdim, p.dstate
        found = _per_layer(cache, "cache", 4)
        if found is None:
            raise InputError(
                "cache: expected the engine's state tensor (num_slots, H, P, N), an (L, num_slots, H, P, N) "
                f"tensor or a non-empty sequence of (num_slots, H, P, N) tensors, got {type(cache).__name__}"
            )
        layers, names = found
        for name, t in zip(names, layers):
            self.tensor(
                name,
                t,
                (p.num_slots, H, P, N),
                (p.state_dtype,),
                what=" (num_slots, heads, headdim, dstate) in Problem.state_dtype",
            )
            _slot_blocks(name, t, "(heads, headdim, dstate) block", p.num_slots)
        return layers

    def scales(self, scales, num_layers: int) -> tuple:
        """The fp32 row scales of each layer of an adopted quantised cache, checked: shape
        (num_slots, H, P), fp32, the kernel's device, a contiguous (H, P) block per slot, one per
        layer of the cache (in the forms :meth:`cache` takes). Empty for a floating-point state,
        which takes none."""

        from ..contract.dtypes import QUANTIZED_STATE_DTYPES

        p = self.problem
        H, P = p.nheads, p.headdim
        if not p.quantized:
            if scales is None:
                return ()
            raise InputError(
                f"scales: a {p.state_dtype} cache has no scales (only {', '.join(QUANTIZED_STATE_DTYPES)} "
                "caches keep them); leave scales out"
            )
        if scales is None:
            raise InputError(
                f"scales: a {p.state_dtype} cache keeps one fp32 scale per (slot, head, row) beside its values; "
                "pass them: kernel.adopt_state(cache, scales=...) with a (num_slots, H, P) fp32 tensor per layer"
            )
        found = _per_layer(scales, "scales", 3)
        if found is None:
            raise InputError(
                "scales: expected a (num_slots, H, P) fp32 tensor, an (L, num_slots, H, P) tensor or a "
                f"non-empty sequence of (num_slots, H, P) tensors, got {type(scales).__name__}"
            )
        layers, names = found
        if len(layers) != num_layers:
            raise InputError(f"scales: {len(layers)} layer(s) of scales for {num_layers} layer(s) of cache")
        for name, t in zip(names, layers):
            self.tensor(name, t, (p.num_slots, H, P), ("fp32",), what=" (num_slots, heads, headdim), fp32")
            _slot_blocks(name, t, "(heads, headdim) block of scales", p.num_slots)
        return layers


def _slot_blocks(name: str, t, block: str, num_slots: int) -> None:
    """An adopted per-slot tensor (a cache, its scales) whose slots are contiguous blocks that do
    not overlap (any slot stride from one block up), as a step writes them in place."""
    strides, inner = t.stride(), contiguous_strides(t.shape[1:])
    if strides[1:] != inner and t[:1].numel() > 1:
        raise InputError(
            f"{name}: each slot's {block} must be contiguous (strides {inner} after the slot's), got strides "
            f"{strides}; keep the engine's tensor in that layout (any slot stride is fine)"
        )
    size = t[:1].numel()
    if num_slots > 1 and strides[0] < size:
        raise InputError(
            f"{name}: a slot stride of {strides[0]} values is less than one slot's {size}: "
            "slots would overlap; give each slot its own block"
        )


def _per_layer(value, name: str, dims: int):
    """``(tensors, names)`` of per-layer tensors of ``dims`` dimensions given as one layer's
    tensor, a stacked ``(L, ...)`` tensor or a non-empty sequence; None for anything else."""
    import torch

    if isinstance(value, torch.Tensor) and value.dim() == dims + 1:
        return tuple(value.unbind(0)), [f"{name}[{i}]" for i in range(value.shape[0])]
    if isinstance(value, torch.Tensor):
        return (value,), [name]
    if isinstance(value, (list, tuple)) and value:
        return tuple(value), [f"{name}[{i}]" for i in range(len(value))]
    return None
