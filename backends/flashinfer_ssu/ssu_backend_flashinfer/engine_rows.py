"""The guarded tables of the engine call forms (docs/spec.md, "Engine call forms"), one Triton
launch a call, for FlashInfer's own forms of them, which read whatever ids they are handed.

``packed_rows``: for vLLM's call, each sequence's start slot written into every column of the
read table (FlashInfer reads the column its count picks), the pad id -1 where the sequence is
padded, its start cell names no slot, or its count lies outside 0..W; the destination table with
-1 where a cell is the pad id, names no slot, lies past the sequence's tokens or belongs to a
padded sequence; the counts with 1 in place of a refused one. Offsets that break the rule (not
ascending within the call's tokens, or more than W tokens) are recorded and replace every offset
by 0: FlashInfer then writes nothing of the call (its kernel does not check a sequence's length
against the table width). ``verify_rows``: for SGLang's call, -1 for a pad row, an id outside the
cache, or a real row whose buffer row lies outside the buffer (FlashInfer would write through
any). Every refused value is recorded in the kernel's fault record (ssu.state.faults, kind 3).

The copy kernel writes the state after a verify call's last token from FlashInfer's buffer into
the cache, which FlashInfer's SM90 kernel leaves alone whenever a buffer is given.
"""

from __future__ import annotations

import triton
import triton.language as tl

# ssu.state.faults: engine_row's fields, kind 3, the argument codes (constexpr: a compiled kernel reads
# no other module global)
E_SLOTS, E_DST_SLOTS, E_NUM_ACCEPTED, E_CU_SEQLENS, E_BUFFER_ROWS, E_ROW_SLOTS = map(tl.constexpr, (0, 1, 2, 3, 5, 6))


@triton.jit
def _key(arg, n, t, value):
    n64 = tl.minimum(n.to(tl.int64), (1 << 19) - 1)
    row = (arg << 26) | (n64 << 7) | t
    return (row << 34) | (3 << 32) | (value.to(tl.int64) & 0xFFFFFFFF)


@triton.jit(do_not_specialize=["sequences", "tokens", "width", "num_slots", "pad"])
def packed_rows_kernel(
    slots_ptr, dst_ptr, accepted_ptr, cu_ptr, read_ptr, write_ptr, counts_ptr, cu_out_ptr, faults_ptr,
    sequences, tokens, width, num_slots, pad, sl_n, sl_t, ds_n, ds_t, out_n,
    HAS_CU: tl.constexpr, HAS_ACCEPTED: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One program over every sequence of the call (BLOCK >= sequences + 1)."""
    n = tl.arange(0, BLOCK)
    inside = n < sequences
    if HAS_CU:
        bos = tl.load(cu_ptr + n, mask=inside, other=0).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1, mask=inside, other=0).to(tl.int64)
    else:
        bos = n.to(tl.int64)
        eos = bos + 1
    length = eos - bos
    ok = (bos >= 0) & (length >= 0) & (length <= width) & (eos <= tokens)
    tl.atomic_min(faults_ptr + 0 * n, _key(E_CU_SEQLENS, n, 0, eos), mask=inside & (ok == 0))
    broken = tl.max((inside & (ok == 0)).to(tl.int32), axis=0)
    if HAS_CU:
        every = n < sequences + 1
        offsets = tl.load(cu_ptr + n, mask=every, other=0)
        tl.store(cu_out_ptr + n, tl.where(broken > 0, 0, offsets).to(cu_out_ptr.dtype.element_ty), mask=every)
    column = tl.zeros_like(length)
    counted = inside
    if HAS_ACCEPTED:
        count = tl.load(accepted_ptr + n, mask=inside, other=1).to(tl.int64)
        counted = inside & (count >= 0) & (count <= width)
        tl.atomic_min(faults_ptr + 0 * n, _key(E_NUM_ACCEPTED, n, 0, count), mask=inside & ok & (counted == 0))
        column = tl.where(counted, tl.maximum(count - 1, 0), 0)
        tl.store(counts_ptr + n, tl.where(counted, count, 1).to(counts_ptr.dtype.element_ty), mask=inside)
    start = tl.load(slots_ptr + n * sl_n + column * sl_t, mask=inside, other=pad).to(tl.int64)
    used = counted & ok & (length > 0)
    outside = ((start < 0) | (start >= num_slots)) & (start != pad)
    tl.atomic_min(faults_ptr + 0 * n, _key(E_SLOTS, n, column, start), mask=used & outside)
    real = counted & (start >= 0) & (start < num_slots) & (start != pad)
    read = tl.where(real, start, -1)
    for t in tl.static_range(W):
        tl.store(read_ptr + n * out_n + t, read.to(read_ptr.dtype.element_ty), mask=inside)
        live = real & (t < length) & ok
        dst = tl.load(dst_ptr + n * ds_n + t * ds_t, mask=live, other=pad).to(tl.int64)
        dst_outside = ((dst < 0) | (dst >= num_slots)) & (dst != pad)
        tl.atomic_min(faults_ptr + 0 * n, _key(E_DST_SLOTS, n, t, dst), mask=live & dst_outside)
        written = live & (dst >= 0) & (dst < num_slots) & (dst != pad)
        tl.store(write_ptr + n * out_n + t, tl.where(written, dst, -1).to(write_ptr.dtype.element_ty), mask=inside)


@triton.jit(do_not_specialize=["batch", "num_slots", "pad", "buffer_rows"])
def verify_rows_kernel(
    slots_ptr, rows_ptr, read_ptr, rows_out_ptr, faults_ptr, batch, num_slots, pad, buffer_rows,
    HAS_BUFFER: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = i < batch
    slot = tl.load(slots_ptr + i, mask=inside, other=pad).to(tl.int64)
    outside = inside & ((slot < 0) | (slot >= num_slots)) & (slot != pad)
    tl.atomic_min(faults_ptr + 0 * i, _key(E_ROW_SLOTS, i, 0, slot), mask=outside)
    real = inside & (slot >= 0) & (slot < num_slots) & (slot != pad)
    row = slot
    if HAS_BUFFER:
        if HAS_ROWS:
            row = tl.load(rows_ptr + i, mask=inside, other=0).to(tl.int64)
        stored = real & (row >= 0) & (row < buffer_rows)
        tl.atomic_min(faults_ptr + 0 * i, _key(E_BUFFER_ROWS, i, 0, row), mask=real & (stored == 0))
        real = stored
        tl.store(rows_out_ptr + i, tl.where(real, row, 0).to(rows_out_ptr.dtype.element_ty), mask=inside)
    tl.store(read_ptr + i, tl.where(real, slot, -1).to(read_ptr.dtype.element_ty), mask=inside)


@triton.jit
def last_state_kernel(cache_ptr, buffer_ptr, read_ptr, rows_ptr, c_slot, b_row, b_step, last, SIZE: tl.constexpr,
                      BLOCK: tl.constexpr):  # fmt: skip
    """cache[read[i]] = buffer[rows[i], last] for the rows whose read id is a slot (>= 0)."""
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(read_ptr + i).to(tl.int64)
    if slot >= 0:
        row = tl.load(rows_ptr + i).to(tl.int64)
        mask = offs < SIZE
        values = tl.load(buffer_ptr + row * b_row + last * b_step + offs, mask=mask)
        tl.store(cache_ptr + slot * c_slot + offs, values, mask=mask)


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def packed_rows(slots, dst, accepted, cu, read, write, counts, cu_out, faults, *, tokens, num_slots, pad) -> None:
    """Fill ``read``, ``write`` (N, W views of (max_batch, T) buffers), ``counts`` and ``cu_out``
    (when given) for one packed call; one launch."""
    N = slots.shape[0] if cu is None else cu.shape[0] - 1
    W = slots.shape[1]
    packed_rows_kernel[(1,)](
        slots, dst, accepted if accepted is not None else slots, cu if cu is not None else slots, read, write,
        counts if counts is not None else read, cu_out if cu_out is not None else read, faults,
        N, tokens, W, num_slots, pad, slots.stride(0), slots.stride(1), dst.stride(0), dst.stride(1), read.stride(0),
        HAS_CU=cu is not None, HAS_ACCEPTED=accepted is not None, W=W, BLOCK=_block(N + 1),
    )  # fmt: skip


def verify_rows(slots, rows, read, rows_out, faults, *, num_slots, pad, buffer_rows) -> None:
    """Fill ``read`` (and ``rows_out``, with a buffer) for one verify call; one launch."""
    b = slots.shape[0]
    block = min(1024, _block(b))
    verify_rows_kernel[(triton.cdiv(b, block),)](
        slots, rows if rows is not None else slots, read, rows_out if rows_out is not None else read, faults,
        b, num_slots, pad, buffer_rows, HAS_BUFFER=buffer_rows > 0, HAS_ROWS=rows is not None, BLOCK=block,
    )  # fmt: skip


def copy_last_states(cache, buffer, read, rows, last: int) -> None:
    """The state after a verify call's last token, from the buffer into the cache (one launch)."""
    size = cache[0].numel()
    block = 1024
    last_state_kernel[(read.shape[0], triton.cdiv(size, block))](
        cache, buffer, read, rows, cache.stride(0), buffer.stride(0), buffer.stride(1), last, SIZE=size, BLOCK=block
    )
