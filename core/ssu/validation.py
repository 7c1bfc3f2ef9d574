"""Checking a call's tensors against the kernel's problem before anything is written.

Full checks run once per *input signature* (shapes, dtypes, devices, which optional tensors are
given, the layer and the state object); later calls with the same signature pay only for building
the signature key. ``validate = "full"`` additionally checks slot values and accepted counts on
every call, which synchronises the host with the device (for debugging, not serving).
"""

from __future__ import annotations

from typing import Any, Optional

from .dtypes import dtype_name
from .errors import InputError
from .problem import Problem
from .records import State

def step_key(state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer) -> tuple:
    """Signature key of one step call: equal keys mean the full check need not run again.

    Written out flat on purpose: this runs on every validated call (about 2 us for 10 tensors on
    a 2-core CPU host; ``validate = false`` skips it).
    """
    return (id(state), state.num_layers, layer, dt_softplus,
            x.shape, x.dtype, x.get_device(), dt.shape, dt.dtype, dt.get_device(),
            A.shape, A.dtype, A.get_device(), B.shape, B.dtype, B.get_device(),
            C.shape, C.dtype, C.get_device(), slots.shape, slots.dtype, slots.get_device(),
            None if D is None else (D.shape, D.dtype, D.get_device()),
            None if z is None else (z.shape, z.dtype, z.get_device()),
            None if dt_bias is None else (dt_bias.shape, dt_bias.dtype, dt_bias.get_device()),
            None if out is None else (out.shape, out.dtype, out.get_device(), out.stride()))


class Checker:
    """Validates tensors for one kernel (problem, capabilities, backend name)."""

    def __init__(self, problem: Problem, backend: str, index_dtypes, shared_commit: bool = False) -> None:
        import torch

        self.problem = problem
        self.backend = backend
        self.index_dtypes = set(index_dtypes)
        self.shared_commit = shared_commit
        self.device = torch.device(problem.device)

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
            raise InputError(f"{name}: expected a tensor on {self.problem.device} (the kernel's device), "
                             f"got one on {t.device}; move it with .to({self.problem.device!r})")
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise InputError(f"{name}: expected shape {want}{what}, got {tuple(t.shape)}")
        got = dtype_name(t.dtype)
        if got not in dtypes:
            raise InputError(f"{name}: expected dtype {' or '.join(dtypes)}, got {got}")

    def state(self, state: Any, layer: Any) -> None:
        if not isinstance(state, State):
            raise InputError(f"state: expected the ssu.State returned by kernel.allocate_state, got {type(state).__name__}")
        if state.backend != self.backend or state.problem != self.problem:
            raise InputError(f"state: it belongs to a kernel for backend {state.backend!r} and problem "
                             f"{state.problem.describe()}; this kernel is {self.backend!r} for {self.problem.describe()}")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < state.num_layers:
            raise InputError(f"layer: expected an integer in [0, {state.num_layers}) for a state of "
                             f"{state.num_layers} layer(s), got {layer!r}")

    def slots(self, slots: Any, name: str = "slots", max_len: Optional[int] = None):
        import torch

        if not isinstance(slots, torch.Tensor):
            raise InputError(f"{name}: expected an int32 or int64 torch.Tensor, got {type(slots).__name__}")
        self.tensor(name, slots, (None,), tuple(sorted(self.index_dtypes)))
        b = slots.shape[0]
        limit = self.problem.max_batch if max_len is None else max_len
        if not 1 <= b <= limit:
            raise InputError(f"{name}: batch of {b} rows; expected 1 to {limit} (Problem.max_batch)")
        return b

    def slot_values(self, slots, *, allow_pad: bool = True, unique: bool = True, name: str = "slots") -> None:
        """Value checks (synchronise the host): range, pad ids, duplicates."""
        p = self.problem
        values = slots.tolist()
        for i, s in enumerate(values):
            if s == p.pad_slot_id and allow_pad:
                continue
            if not 0 <= s < p.num_slots:
                raise InputError(f"{name}[{i}] = {s}: not a slot of this cache (0..{p.num_slots - 1}"
                                 f"{f' or pad id {p.pad_slot_id}' if allow_pad else ''})")
        real = [s for s in values if s != p.pad_slot_id]
        if unique and len(set(real)) != len(real):
            dup = sorted({s for s in real if real.count(s) > 1})
            raise InputError(f"{name}: slot(s) {dup} appear more than once; each sequence needs its own slot")

    # calls ---------------------------------------------------------------------------------------
    def step(self, state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer) -> None:
        p = self.problem
        self.state(state, layer)
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
                raise InputError(f"x: {T} tokens per sequence; expected 1 to {p.tokens_per_step} (Problem.tokens_per_step)")
            lead = (b, T)
        else:
            lead = (b,)
        self.tensor("x", x, lead + (H, P), inp, what=" (batch, tokens, heads, headdim)" if p.multi_token else " (batch, heads, headdim)")
        self.tensor("dt", dt, lead + (H,), wide)
        self.tensor("A", A, (H,), ("fp32",))
        self.tensor("B", B, lead + (G, N), inp)
        self.tensor("C", C, lead + (G, N), inp)
        if D is not None:
            self.tensor("D", D, (H,), wide)
        if dt_bias is not None:
            self.tensor("dt_bias", dt_bias, (H,), wide)
        if z is not None:
            self.tensor("z", z, lead + (H, P), inp)
        if out is not None:
            self.tensor("out", out, lead + (H, P), inp)
            if 0 in out.stride() and out.numel() > 1:
                raise InputError("out: has a zero stride (an expanded view); give a tensor that owns its memory")
        if not isinstance(dt_softplus, bool):
            raise InputError(f"dt_softplus: expected True or False, got {dt_softplus!r}")

    def commit(self, state, slots, num_accepted) -> None:
        self.state(state, 0)
        if not self.problem.speculative and not self.shared_commit:
            raise InputError("commit: this kernel was opened with speculative=False, where step commits at once; "
                             "open it with Problem(speculative=True, tokens_per_step=T) to verify draft tokens")
        b = self.slots(slots)
        self.tensor("num_accepted", num_accepted, (b,), ("int32", "int64"))

    def accepted_values(self, num_accepted) -> None:
        T = self.problem.tokens_per_step
        bad = [(i, n) for i, n in enumerate(num_accepted.tolist()) if not 1 <= n <= T]
        if bad:
            i, n = bad[0]
            raise InputError(f"num_accepted[{i}] = {n}: expected 1 to {T} (at least the first token is always kept)")

    def read(self, state, slots, layer) -> None:
        self.state(state, layer)
        self.slots(slots, max_len=self.problem.num_slots)
        self.slot_values(slots, allow_pad=False, unique=False)

    def write(self, state, slots, values, layer) -> None:
        p = self.problem
        self.state(state, layer)
        b = self.slots(slots, max_len=p.num_slots)
        self.slot_values(slots, allow_pad=False, unique=True)
        self.tensor("values", values, (b, p.nheads, p.headdim, p.dstate), ("fp32", "bf16", "fp16", "fp64"))
