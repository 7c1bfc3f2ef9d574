"""The bytes one step must move in device memory: the traffic floor ``ssu bench`` reports each row
against.

A write-every-step backend reads each state once and writes it once per token; a backend that
keeps more (a checkpoint and a ring of recent inputs) says what it moves through the optional hook
``ssu_traffic``. Both add the step's inputs and outputs, which every backend moves alike. Each byte
is counted once, as if every cache line came from memory exactly once: the floor no kernel can beat
on this problem, and the fraction of it a measured time reaches says how much is left.
"""

from __future__ import annotations

from typing import Mapping

from ..contract.dtypes import ITEMSIZE

#: a step's traffic: bytes by part name
Traffic = Mapping[str, float]


def io_bytes(problem, batch: int, with_z: bool = True) -> int:
    """Bytes of a step's inputs and outputs at ``batch`` rows: x, dt, B, C (and z) read, the output
    written, per token; the per-head weights (A, D, dt_bias) are too small to count."""
    p = problem
    inp = ITEMSIZE[p.input_dtype]
    heads = p.nheads * p.headdim * (3 if with_z else 2)  # x, out, z
    per_token = (heads + p.nheads + 2 * p.ngroups * p.dstate) * inp
    return batch * p.tokens_per_step * per_token


def write_through(problem, batch: int, with_z: bool = True) -> dict:
    """The traffic of a backend that writes every state it steps: one read and, per token, one
    write of each state (the speculative kernels' per-token states included)."""
    slot = problem.state_bytes_per_slot()
    return {
        "state read": batch * slot,
        "state write": batch * slot * problem.tokens_per_step,
        "inputs and outputs": io_bytes(problem, batch, with_z),
    }


def checkpoint_and_ring(
    problem, batch: int, *, window: int, accepted: float, token_bytes: int, folds_new: bool
) -> dict:
    """The steady-state traffic of a checkpoint-and-ring backend (ReplaySSM) at flush window
    ``window``, its rows at every point of their windows alike (a running server): every
    checkpoint read; the checkpoint writes of the rows that flush, amortised over the steps between
    two flushes of a row; the ring tokens read and appended (``token_bytes`` each).

    ``folds_new``: a flush folds the step's own token too and empties the ring (one-token steps
    that flush when ``count + 1 > window``: ``window + 1`` steps a cycle, ``window / 2`` tokens held
    on average). Otherwise the new tokens stay in the ring and a flush folds only the old ones,
    when ``count + T > window``; a row then holds ``accepted``, ``2 accepted``, ... tokens
    (``accepted``: mean tokens a step keeps)."""
    T = problem.tokens_per_step
    if folds_new:
        cycle = window + 1
        held = window / 2
        appended = T * window / cycle
    else:
        kept = max(float(accepted), 1.0)
        cycle = int((window - T) // kept) + 1 if window >= T else 1
        held = kept * (cycle + 1) / 2
        appended = T
    slot = problem.state_bytes_per_slot()
    return {
        "checkpoint read": batch * slot,
        "checkpoint write": batch * slot / cycle,
        "ring read": batch * token_bytes * held,
        "ring write": batch * token_bytes * appended,
    }


def total(traffic: Traffic) -> float:
    """All of a step's bytes."""
    return float(sum(traffic.values()))
