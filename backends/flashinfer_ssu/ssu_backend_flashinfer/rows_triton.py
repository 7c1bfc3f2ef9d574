"""One Triton launch for a step's guarded cache rows, where Triton runs (CUDA, or its interpreter):
the same rows as the torch ops of :func:`ssu_backend_flashinfer.rows.guarded_rows`, which take
about fifteen small launches.

Each row: a slot outside the cache is recorded in the fault record and becomes a pad row; a pad
row reads ``pad_read`` (FlashInfer's pad id, or ReplaySSM's pad slot); with destinations, a real
row whose destination is the pad id or outside the cache writes to ``sink``; with a cursor (a
speculative step on an allocated state), the rows of versions ``slot * K + cursor`` and
``slot * K + (cursor + 1 + t) % K``.
"""

from __future__ import annotations

import importlib.util
import os

_kernel = None


def usable(device_type: str) -> bool:
    """Whether this launch can run for tensors on ``device_type``."""
    if importlib.util.find_spec("triton") is None:
        return False
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _rows_kernel():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit(do_not_specialize=["batch", "num_slots", "pad", "pad_read", "sink"])
        def rows_kernel(
            slots_ptr,
            dst_ptr,
            cursor_ptr,
            read_ptr,
            write_ptr,
            faults_ptr,
            batch,
            num_slots,
            pad,
            pad_read,
            sink,
            HAS_DST: tl.constexpr,
            CURSOR: tl.constexpr,
            K: tl.constexpr,
            T: tl.constexpr,
            BLOCK: tl.constexpr,
        ):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            inside = offs < batch
            slot = tl.load(slots_ptr + offs, mask=inside, other=pad).to(tl.int64)
            real = inside & (slot >= 0) & (slot < num_slots) & (slot != pad)
            outside = inside & ((slot < 0) | (slot >= num_slots)) & (slot != pad)
            tl.atomic_min(faults_ptr + 0 * offs, (offs.to(tl.int64) << 34) | (slot & 0xFFFFFFFF), mask=outside)
            if CURSOR:
                safe = tl.where(real, slot, sink)
                cur = tl.load(cursor_ptr + safe, mask=inside, other=0).to(tl.int64)
                base = safe * K
                tl.store(
                    read_ptr + offs, tl.where(real, base + cur, pad_read).to(read_ptr.dtype.element_ty), mask=inside
                )
                for t in tl.static_range(T):
                    tl.store(
                        write_ptr + offs * T + t, (base + (cur + 1 + t) % K).to(write_ptr.dtype.element_ty), mask=inside
                    )
            else:
                tl.store(read_ptr + offs, tl.where(real, slot, pad_read).to(read_ptr.dtype.element_ty), mask=inside)
                if HAS_DST:
                    dst = tl.load(dst_ptr + offs, mask=inside, other=pad).to(tl.int64)
                    dst_outside = inside & ((dst < 0) | (dst >= num_slots)) & (dst != pad)
                    tl.atomic_min(
                        faults_ptr + 0 * offs,
                        (offs.to(tl.int64) << 34) | (1 << 32) | (dst & 0xFFFFFFFF),
                        mask=dst_outside,
                    )
                    written = real & (dst >= 0) & (dst < num_slots) & (dst != pad)
                    tl.store(write_ptr + offs, tl.where(written, dst, sink).to(write_ptr.dtype.element_ty), mask=inside)

        _kernel = rows_kernel
    return _kernel


def launch(
    slots,
    dst_slots,
    cursor,
    read,
    write,
    faults,
    *,
    num_slots: int,
    pad_slot_id: int,
    pad_read: int,
    sink: int,
    versions: int = 1,
    tokens: int = 1,
) -> None:
    """Fill ``read`` (b,) and ``write`` ((b,), (b, tokens), or unused) for one step; one launch."""
    import triton

    b = slots.shape[0]
    block = min(1024, triton.next_power_of_2(b))
    _rows_kernel()[(triton.cdiv(b, block),)](
        slots,
        slots if dst_slots is None else dst_slots,
        slots if cursor is None else cursor,
        read,
        read if write is None else write,
        faults,
        b,
        num_slots,
        pad_slot_id,
        pad_read,
        sink,
        HAS_DST=dst_slots is not None,
        CURSOR=cursor is not None,
        K=versions,
        T=tokens,
        BLOCK=block,
    )
