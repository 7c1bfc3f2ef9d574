"""The buffers a kernel allocates once, before any CUDA-graph capture: a zero D in each weight dtype,
the cache-row buffers of :mod:`.rows`, the stochastic-rounding seed, and the engine call forms'
scratch (:mod:`.engine_forms`)."""

from __future__ import annotations

import torch

from ssu.contract.dtypes import to_torch

from . import rows_triton
from .engine_forms import engine_scratch
from .rows import row_buffers


def allocate_scratch(problem, options) -> dict:
    """Buffers allocated once per kernel, before any CUDA-graph capture."""
    p = problem
    dev = p.device
    scratch = {
        "zero_D": {
            dtype: torch.zeros(p.nheads, dtype=dtype, device=dev) for dtype in {torch.float32, to_torch(p.input_dtype)}
        },
        "rows_for": None,
        "triton_rows": rows_triton.usable(p.device_type),
        "rows": {dtype: row_buffers(p, dtype, dev) for dtype in (torch.int32, torch.int64)},
    }
    if options.stochastic_rounding:
        scratch["seed"] = torch.randint(0, 2**62, (1,), dtype=torch.int64).to(dev)
    if p.engine_calls:
        scratch["engine"] = engine_scratch(p)
    return scratch
