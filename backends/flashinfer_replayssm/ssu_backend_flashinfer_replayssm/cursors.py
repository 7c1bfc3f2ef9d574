"""The ring cursors of ReplaySSM and the rule that moves them after each step (docs/spec.md, "ReplaySSM").

Per slot, ``ring_start`` is the ring row of the oldest token not yet folded into the checkpoint and
``pnat`` (prev_num_accepted_tokens) how many such tokens there are. FlashInfer's kernel reads them
but never moves them: a step appends its T tokens at rows ``(ring_start + pnat + i) % L`` and,
when ``pnat + T > max_window``, folds the ``pnat`` old tokens into the checkpoint ("flush").
After acceptance the cursors move by the same rule::

    flush = pnat + T > max_window
    if flush: ring_start = (ring_start + pnat) % L; pnat = num_accepted
    else:     pnat = pnat + num_accepted

A row whose count is refused (outside 1..T) keeps nothing of the step, num_accepted 0 in the rule:
its cursors still move past the old tokens when the step flushed them, since the checkpoint
already holds them, and the slot's state is the one before the step.

The cursor buffers hold ``num_slots + 2`` entries: FlashInfer sees the first ``num_slots + 1``
(the last of those is the pad slot, whose cursors stay at zero so that a pad row reads a zero
state), and the final entry is a sink that absorbs pad rows in the torch implementation.

:func:`advance_torch` is plain torch (any device, CUDA-graph capturable, ~10 small launches);
:func:`advance_triton` is one Triton launch used on CUDA when Triton is installed. Both skip pad
rows, and rows whose slot lies outside the cache or whose accepted count lies outside 1..T (those
recorded in the kernel's fault record), and are checked against :func:`advance_model` (plain
Python) in the tests.
"""

from __future__ import annotations


def advance_model(ring_start: int, pnat: int, accepted: int, tokens: int, max_window: int) -> tuple:
    """The rule for one slot in plain Python: (new ring_start, new pnat); a count outside 1..T
    keeps no token."""
    ring = max_window + tokens
    accepted = accepted if 1 <= accepted <= tokens else 0
    if pnat + tokens > max_window:
        return (ring_start + pnat) % ring, accepted
    return ring_start, pnat + accepted


def pad_slot(num_slots: int) -> int:
    """Row that pad rows of a step are pointed to: its checkpoint is zero and its cursors stay 0."""
    return num_slots


def advance_torch(
    ring_start, pnat, slots, accepted, record, *, tokens: int, max_window: int, pad_slot_id: int, num_slots: int
) -> None:
    """The rule with torch ops, in place, for the rows of ``slots`` that name a slot of the cache
    (a count outside 1..tokens keeping no token); ids outside the cache and such counts are
    recorded in ``record``."""
    import torch

    from ssu.state import faults

    real = (slots >= 0) & (slots < num_slots) & (slots != pad_slot_id)
    counted = (accepted >= 1) & (accepted <= tokens)
    faults.record(record, faults.outside(slots, num_slots, pad_slot_id), slots, faults.SLOTS)
    faults.record(record, real & ~counted, accepted, faults.NUM_ACCEPTED)
    sink = num_slots + 1
    idx = torch.where(real, slots, torch.full_like(slots, sink)).long()
    start = ring_start[idx]
    count = pnat[idx]
    acc = torch.where(counted, accepted, torch.zeros_like(accepted)).to(pnat.dtype)
    flush = count + tokens > max_window
    ring_start.index_put_((idx,), torch.where(flush, (start + count) % (max_window + tokens), start))
    pnat.index_put_((idx,), torch.where(flush, acc, count + acc))


_kernel = None


def _triton_kernel():
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def advance_kernel(
            ring_start,
            pnat,
            slots,
            accepted,
            record,
            batch,
            pad_slot_id,
            num_slots,
            TOKENS: tl.constexpr,
            MAX_WINDOW: tl.constexpr,
            BLOCK: tl.constexpr,
        ):
            rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            inside = rows < batch
            slot = tl.load(slots + rows, mask=inside, other=pad_slot_id).to(tl.int64)
            real = inside & (slot >= 0) & (slot < num_slots) & (slot != pad_slot_id)
            acc = tl.load(accepted + rows, mask=real, other=1).to(tl.int64)
            counted = (acc >= 1) & (acc <= TOKENS)
            outside = inside & ((slot < 0) | (slot >= num_slots)) & (slot != pad_slot_id)
            keys = tl.where(
                outside,
                (rows.to(tl.int64) << 34) | (slot & 0xFFFFFFFF),
                (rows.to(tl.int64) << 34) | (2 << 32) | (acc & 0xFFFFFFFF),
            )
            tl.atomic_min(record + 0 * rows, keys, mask=outside | (real & ~counted))
            live = real  # a refused count keeps no token, but the cursors still pass a flush
            slot = tl.where(live, slot, 0)
            start = tl.load(ring_start + slot, mask=live, other=0)
            count = tl.load(pnat + slot, mask=live, other=0)
            acc = tl.where(counted, acc, 0).to(tl.int32)
            flush = count + TOKENS > MAX_WINDOW
            new_start = tl.where(flush, (start + count) % (MAX_WINDOW + TOKENS), start)
            new_count = tl.where(flush, acc, count + acc)
            tl.store(ring_start + slot, new_start, mask=live)
            tl.store(pnat + slot, new_count, mask=live)

        _kernel = advance_kernel
    return _kernel


def triton_usable(device_type: str) -> bool:
    """Whether :func:`advance_triton` can run for tensors on ``device_type``."""
    import importlib.util
    import os

    if importlib.util.find_spec("triton") is None:
        return False
    return device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def advance_triton(
    ring_start, pnat, slots, accepted, record, *, tokens: int, max_window: int, pad_slot_id: int, num_slots: int
) -> None:
    """The rule in one Triton launch (no host synchronisation), in place, with the same guards."""
    batch = slots.shape[0]
    block = 128 if batch > 64 else 64
    grid = ((batch + block - 1) // block,)
    _triton_kernel()[grid](
        ring_start,
        pnat,
        slots,
        accepted,
        record,
        batch,
        pad_slot_id,
        num_slots,
        TOKENS=tokens,
        MAX_WINDOW=max_window,
        BLOCK=block,
    )
