"""The input signatures a kernel's checks have passed: what a later call is compared with instead
of being checked again.

A signature is the dtype, device and sizes of a call's tensors (and the strides of some), which
:class:`Signatures` compares in C++ where torch offers it (dynamo's tensor guards, about 1 us for
ten tensors) and else with a Python key (:mod:`ssu.runtime.validation` does the checks themselves).
"""

from __future__ import annotations

from typing import Optional

from ..contract import protocols

#: signatures remembered per kernel; the oldest is forgotten beyond this
MAX_SIGNATURES = 16


def tensor_guards():
    """torch's C++ tensor-metadata guard class (dynamo's), or None where this torch has none."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except ImportError:  # pragma: no cover - every torch >= 2.1 has it
        return None
    return TensorGuards


#: where the tensors of a call sit in a signature: the contract's tensor parameters, in order
_POSITIONS = {name: i for i, name in enumerate(protocols.TENSOR_NAMES)}
#: tensors whose strides, from the given dimension on, are part of every signature: out (what was
#: checked of it), the per-head parameters (stride 0 along P and N where expanded) and the slot ids
#: (read as contiguous vectors)
STATIC_STRIDES: dict[str, int] = {"out": 0, **{n: 1 for n in protocols.PER_HEAD}, "slots": 0, "dst_slots": 0}


def _python_key(tensors, static: tuple) -> tuple:
    """A signature as a Python key: what the guards compare."""
    return tuple((t.shape, t.dtype, t.device) for t in tensors) + tuple(tensors[i].stride()[d:] for i, d in static)


class Signatures:
    """The input signatures of one kernel that passed the full check.

    A signature is the dtype, device, sizes (and, for the tensors of ``static``, by default
    :data:`STATIC_STRIDES`, strides) of the call's tensor arguments (``ssu.contract.TENSOR_NAMES``, in that order,
    or ``names`` for another call, ``optional`` those that may be absent), an absent optional one standing as
    an empty placeholder. :meth:`seen` compares a call against the
    remembered signatures; it never raises (a non-tensor simply matches none). torch's guards also
    compare autograd and dispatch state, and never match a call that passes one tensor as two
    arguments: such calls take the full check each time, never a wrong answer.
    """

    def __init__(
        self,
        use_guards: bool = True,
        static: Optional[dict] = None,
        names: Optional[tuple] = None,
        optional: frozenset = frozenset(),
    ) -> None:
        import torch

        if names is None:  # the step's tensors
            names, optional, positions = protocols.TENSOR_NAMES, protocols.OPTIONAL_TENSORS, _POSITIONS
        else:  # another call's (an engine call form's), ``optional`` those that may be None
            positions = {n: i for i, n in enumerate(names)}
        #: (position, first dimension) of the strides each signature holds
        static = STATIC_STRIDES if static is None else static
        self._static = tuple((positions[n], d) for n, d in static.items() if n in positions)
        self._guard_class = tensor_guards() if use_guards else None
        #: what stands for an absent optional tensor, one each (the guards never match a tensor
        #: passed twice): callers pass these instead of None (:meth:`arguments` says how)
        self.placeholders = {n: torch.empty(0) for n in names if n in optional}
        self._entries: list = []

    @staticmethod
    def arguments() -> str:
        """Source of the tensor arguments of :meth:`seen` and :meth:`add`, placeholders
        (``NONE_<name>``) standing for absent optional ones: what a generated step passes."""
        return ", ".join(
            f"{n} if {n} is not None else NONE_{n}" if n in protocols.OPTIONAL_TENSORS else n
            for n in protocols.TENSOR_NAMES
        )

    def seen(self, *tensors) -> bool:
        """Whether the call's tensors (placeholders for absent ones) match a remembered signature."""
        if self._guard_class is not None:
            entries = self._entries
            for i, guard in enumerate(entries):
                if guard.check(*tensors):
                    if i:  # the last signature matched is compared first next time
                        entries.insert(0, entries.pop(i))
                    return True
            return False
        try:
            key = _python_key(tensors, self._static)
        except AttributeError:
            return False
        return key in self._entries

    def add(self, *tensors) -> None:
        """Remember a signature that passed the full check."""
        entry = None
        if self._guard_class is not None:
            strides = [[None] * t.dim() for t in tensors]
            for i, d in self._static:
                strides[i][d:] = list(tensors[i].stride()[d:])
            try:
                entry = self._guard_class(
                    *tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors], dynamic_dims_strides=strides
                )
            except Exception:  # a torch whose guard class takes other arguments: the Python key
                self._guard_class = None
                self._entries.clear()
        if entry is None:
            entry = _python_key(tensors, self._static)
        self._entries.insert(0, entry)
        del self._entries[MAX_SIGNATURES:]
