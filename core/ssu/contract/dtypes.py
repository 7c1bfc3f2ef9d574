"""Dtype names: the framework speaks in short names ("fp32", "bf16", "fp16") so that configs,
capabilities and listings never need torch; conversion to ``torch.dtype`` happens lazily."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from .errors import ConfigError

#: canonical short name for every spelling we accept
_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "fp64": "fp64",
    "float64": "fp64",
    "double": "fp64",
    "torch.float64": "fp64",
    "int8": "int8",
    "torch.int8": "int8",
    "fp8_e4m3": "fp8_e4m3",
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "torch.float8_e4m3fn": "fp8_e4m3",
    "int32": "int32",
    "torch.int32": "int32",
    "int64": "int64",
    "torch.int64": "int64",
}

#: floating-point state cache dtypes: what a backend serves unless its capabilities say otherwise
FLOAT_STATE_DTYPES = ("fp32", "bf16", "fp16")
#: 8-bit state cache dtypes, kept with one fp32 scale per (slot, head, row) (:mod:`ssu.state.quant`)
QUANTIZED_STATE_DTYPES = ("int8", "fp8_e4m3")
#: dtypes a state cache may have
STATE_DTYPES = FLOAT_STATE_DTYPES + QUANTIZED_STATE_DTYPES
#: the magnitude a row's scale maps the row's largest value to, per quantised dtype
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
#: dtypes the inputs x, B, C, z may have
INPUT_DTYPES = ("bf16", "fp16", "fp32")
#: dtypes of the slot index tensor
INDEX_DTYPES = ("int32", "int64")

#: bytes per element of each canonical name
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8, "int8": 1, "fp8_e4m3": 1, "int32": 4, "int64": 8}


def state_slot_bytes(nheads: int, headdim: int, dstate: int, state_dtype: str) -> int:
    """Bytes of one slot's state in one layer: H x P x N values of the state dtype, and for an
    8-bit cache its H x P fp32 row scales."""
    scales = nheads * headdim * 4 if state_dtype in QUANTIZED_STATE_DTYPES else 0
    return nheads * headdim * dstate * ITEMSIZE[state_dtype] + scales


def dtype_name(value: Any, *, what: str = "dtype", valid: Optional[Sequence[str]] = None) -> str:
    """Return the canonical short name of ``value`` (a string or a ``torch.dtype``). A name ssu
    does not know is an error whose remedy lists ``valid`` (the dtypes ``what`` may be; default
    every known one), so that it never suggests one the caller then refuses.

    >>> dtype_name("bfloat16")
    'bf16'
    """
    key = str(value).lower()
    if key in _ALIASES:
        return _ALIASES[key]
    names = ", ".join(valid if valid is not None else sorted(set(_ALIASES.values())))
    raise ConfigError(f"{what}: {value!r} is not a dtype ssu knows; use one of {names}")


def dtype_in(value: Any, valid: Sequence[str], *, what: str, kind: str) -> str:
    """The canonical name of ``value`` if it is one of ``valid``, in any spelling ssu knows
    (``fp8``, ``float8_e4m3fn``, ``torch.bfloat16``, a ``torch.dtype``). The one parser of every
    field, option and setting that takes a dtype name, so that each takes the same spellings and
    refuses the others alike: ``what`` names it in the error, ``kind`` says what the dtype must
    be ("a state cache dtype"), and the remedy lists ``valid``.

    >>> dtype_in("fp8", STATE_DTYPES, what="state_dtype", kind="a state cache dtype")
    'fp8_e4m3'
    """
    name = dtype_name(value, what=what, valid=valid)
    if name not in valid:
        spelled = name if str(value) == name or not isinstance(value, str) else f"{value} ({name})"
        raise ConfigError(f"{what}: {spelled} is not {kind}; use one of {', '.join(valid)}")
    return name


def dtype_list(text: str, valid: Sequence[str], *, what: str, kind: str) -> list[str]:
    """``"fp32,bfloat16"`` -> ``["fp32", "bf16"]``: comma-separated names, each as :func:`dtype_in`
    takes it, in the order given without repeats; at least one.

    >>> dtype_list("fp32, bfloat16,float32", STATE_DTYPES, what="states", kind="a state cache dtype")
    ['fp32', 'bf16']
    """
    names = []
    for item in str(text).split(","):
        if item.strip():
            name = dtype_in(item.strip(), valid, what=what, kind=kind)
            names += [name] if name not in names else []
    if not names:
        raise ConfigError(
            f"{what}: {str(text)!r} names no dtype; give one or more of {', '.join(valid)}, comma-separated"
        )
    return names


def to_torch(name: str):
    """The ``torch.dtype`` for a canonical name (imports torch)."""
    import torch

    return {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp64": torch.float64,
        "int8": torch.int8,
        "fp8_e4m3": torch.float8_e4m3fn,
        "int32": torch.int32,
        "int64": torch.int64,
    }[dtype_name(name)]
