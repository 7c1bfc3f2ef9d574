"""How an engine call's tensors sit in memory (docs/spec.md, "Engine call forms"): the layouts the
conformance kit and :mod:`.call_draws` lay inputs, index tables and intermediate-state buffers out
in, and the functions that copy a tensor's values into each.

The "rows" and "strided" layouts are views into a larger tensor whose other cells hold NaN (or, for
a table, an id outside the cache), so a kernel that reads past the view shows it; "transposed"
stores a table column by column.
"""

from __future__ import annotations


#: how the inputs of an engine call (x, dt, B, C, z and a given out) sit in memory: as allocated;
#: each token's row contiguous, the token stride free (slices of a projection, as engines pass
#: them); every dimension strided
INPUT_LAYOUTS = ("contiguous", "rows", "strided")
#: how an engine call's index tables (the packed call's slot and destination tables, a verify
#: call's parents) and a verify call's buffer sit in memory: as allocated; a view with strides of
#: its own (every other column of a wider table; buffer rows and steps further apart, each
#: (H, P, N) block contiguous); transposed storage (tables only)
TABLE_LAYOUTS = ("contiguous", "strided", "transposed")
BUFFER_LAYOUTS = ("contiguous", "strided")


def laid_out(t, layout: str, lead: int, *, aligned: bool = False):
    """``t``'s values in a new tensor of ``layout`` (:data:`INPUT_LAYOUTS`), its first ``lead``
    dimensions being the leading (token, or row and token) ones; with ``aligned`` each row of the
    "rows" layout starts at a multiple of 16 bytes (what ``contiguous_rows`` asks). The memory
    around the view is NaN, so a read past a row shows."""
    import math

    import torch

    from ..runtime.validation import contiguous_strides

    if t is None or layout == "contiguous":
        return t
    if layout == "rows":
        inner = t.shape[lead:]
        width = math.prod(inner)
        packet = max(16 // t.element_size(), 1)
        row = width + ((-width) % packet + packet if aligned else 3)
        lead_strides = tuple(row * v for v in contiguous_strides(t.shape[:lead]))
        big = torch.full((max(row * math.prod(t.shape[:lead]), 1),), float("nan"), dtype=t.dtype, device=t.device)
        view = big.as_strided(t.shape, lead_strides + contiguous_strides(inner))
        view.copy_(t)
        return view
    big = torch.full((*t.shape, 2), float("nan"), dtype=t.dtype, device=t.device)
    view = big[..., 0]
    view.copy_(t)
    return view


def table_laid_out(t, layout: str, fill: int):
    """An index table's values in a new tensor of ``layout`` (:data:`TABLE_LAYOUTS`); the cells
    around a strided view hold ``fill`` (an id outside the cache, which a misread then uses)."""
    import torch

    if t is None or layout == "contiguous":
        return t
    if layout == "transposed":
        return t.t().contiguous().t()
    rows, cols = t.shape
    big = torch.full((rows, 2 * cols + 1), fill, dtype=t.dtype, device=t.device)
    view = big[:, 1::2]
    view.copy_(t)
    return view


def buffer_laid_out(t, layout: str):
    """An intermediate-state buffer's values in a new tensor of ``layout`` (:data:`BUFFER_LAYOUTS`):
    "strided" takes every other row of a buffer with two steps more per row, so rows and steps
    have strides of their own while each (H, P, N) block stays contiguous; the memory around it
    is NaN."""
    import torch

    if t is None or layout == "contiguous":
        return t
    rows, steps = t.shape[:2]
    big = torch.full((2 * rows, steps + 2, *t.shape[2:]), float("nan"), dtype=t.dtype, device=t.device)
    view = big[::2, 1 : steps + 1]
    view.copy_(t)
    return view
