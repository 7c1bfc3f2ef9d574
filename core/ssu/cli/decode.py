"""The main job: a decode run over a Mamba2-shaped stack of layers through one kernel.

Every layer of every step goes through ``kernel.step`` (and ``kernel.commit`` once per step when
speculative, with random acceptance). Along the way outputs and states are checked against the
float64 oracle started from the kernel's own state, and slots outside the batch are checked to be
bit-identical at the end. Kernel time excludes the checks.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import attrs

from ..checking import oracle
from ..checking.inputs import layer_weights, pick_slots, random_states, step_inputs


@attrs.define
class DecodeReport:
    """What ``ssu run`` prints."""

    backend: str
    problem: object
    layers: int
    steps: int
    batch: int
    pad_rows: int
    seconds: float = 0.0
    state_bytes: int = 0
    max_out_error: float = 0.0
    max_state_error: float = 0.0
    checked_layer_steps: int = 0
    out_tolerance: float = 0.0
    state_tolerance: float = 0.0
    untouched_checked: int = 0
    untouched_changed: int = 0
    wall_seconds: float = 0.0
    #: an 8-bit cache's worst value: its error over what rounding with its row's scale allows
    #: (``oracle.rounding_bound``; at most 1 when right; None for a float cache)
    max_rounding: Optional[float] = None

    @property
    def checked(self) -> bool:
        """Whether any layer-step was compared with the oracle."""
        return self.checked_layer_steps > 0

    @property
    def ok(self) -> bool:
        """Whether every checked output and state was within tolerance and no slot outside the batch changed."""
        return (
            self.max_out_error <= self.out_tolerance
            and self.max_state_error <= self.state_tolerance
            and (self.max_rounding is None or self.max_rounding <= 1.0)
            and self.untouched_changed == 0
        )

    def summary(self) -> str:
        """The report as the lines ``ssu run`` prints: what ran, its errors against the reference, the verdict."""
        from ..contract.errors import counted

        layer_steps = self.layers * self.steps
        if self.checked:
            errors = (
                f"max error       out {self.max_out_error:.2e} (budget {self.out_tolerance:.1e}), "
                f"state {self.max_state_error:.2e} (budget {self.state_tolerance:.1e}); "
                f"{counted(self.checked_layer_steps, 'layer-step')} checked"
            )
            result = "OK" if self.ok else "WRONG"
        else:
            errors = "max error       not checked (--check-every 0: no layer-step compared with the oracle)"
            result = "WRONG" if not self.ok else "not checked (timing only; untouched slots compared)"
        lines = [
            f"backend         {self.backend}",
            f"problem         {self.problem.describe()}",
            f"run             {counted(self.layers, 'layer')} x {counted(self.steps, 'step')}, batch {self.batch}"
            + (f" ({counted(self.pad_rows, 'pad row')})" if self.pad_rows else ""),
            f"step rate       {self.steps / self.seconds:.1f} steps/s, kernel calls only (checks not timed)"
            if self.seconds
            else "step rate       -",
            f"wall time       {self.wall_seconds:.2f} s, checks and set-up included",
            f"per layer-step  {self.seconds / layer_steps * 1e6:.1f} us",
            f"state traffic   {self.state_bytes / self.seconds / 1e9:.2f} GB/s "
            f"({self.state_bytes / layer_steps / 1e6:.2f} MB per layer-step)"
            if self.seconds
            else "",
            errors,
            f"rounding        every written value within {self.max_rounding:.2f} of what rounding to "
            f"{self.problem.state_dtype} with its row's scale allows (at most 1; docs/spec.md, Quantised states)"
            if self.checked and self.max_rounding is not None
            else "",
            f"untouched slots {self.untouched_checked} checked, {self.untouched_changed} changed",
            f"result          {result}",
        ]
        return "\n".join(line for line in lines if line)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def decode_run(
    kernel,
    *,
    layers: int,
    steps: int,
    batch: int,
    seed: int = 0,
    pad_rows: int = 0,
    check_every: int = 1,
    progress: Optional[Callable[[int], None]] = None,
) -> DecodeReport:
    """Run ``steps`` decode steps of ``layers`` layers for ``batch`` sequences; see the module doc."""
    import torch

    wall = time.perf_counter()
    p = kernel.problem
    gen = torch.Generator().manual_seed(seed)
    T = p.tokens_per_step
    out_tol, state_tol = oracle.tolerances(p, T, kernel.capabilities.state_precision)
    report = DecodeReport(
        kernel.backend, p, layers, steps, batch, pad_rows, out_tolerance=out_tol, state_tolerance=state_tol
    )
    state = kernel.allocate_state(num_layers=layers)
    all_slots = torch.tensor([s for s in range(p.num_slots) if s != p.pad_slot_id], dtype=torch.int64, device=p.device)
    for layer in range(layers):  # every slot starts from a random state
        kernel.write_state(state, all_slots, random_states(p, len(all_slots), gen), layer)
    slots = pick_slots(p, batch, gen, pad_rows=pad_rows)
    real = slots[: batch - pad_rows]
    others = set(range(p.num_slots)) - set(real.tolist()) - {p.pad_slot_id}
    untouched = torch.tensor(sorted(others)[:8], dtype=torch.int64, device=p.device)
    before = [kernel.read_state(state, untouched, layer).clone() for layer in range(layers)] if len(untouched) else []
    weights = [layer_weights(p, gen) for _ in range(layers)]
    out = None
    kernel.warmup(state)
    writes = T if p.speculative else 1
    for step_index in range(steps):
        check = check_every > 0 and step_index % check_every == 0
        expected_states, starts = [], []
        for layer in range(layers):
            inputs = step_inputs(p, slots, gen, weights=weights[layer])
            if out is None:
                out = torch.empty_like(inputs.x)
            if check:
                start = torch.zeros(batch, p.nheads, p.headdim, p.dstate, device=p.device)
                start[: batch - pad_rows] = kernel.read_state(state, real, layer)
            _sync(p.device)
            t0 = time.perf_counter()
            kernel.step(state, out=out, layer=layer, **inputs.kwargs())
            _sync(p.device)
            report.seconds += time.perf_counter() - t0
            report.state_bytes += (batch - pad_rows) * p.state_bytes_per_slot() * (1 + writes)
            if check:
                states, outs = oracle.step_math64(p, start, inputs)
                starts.append(start)
                report.max_out_error = max(report.max_out_error, oracle.rel_error(oracle.with_token_axis(p, out), outs))
                expected_states.append(states)
        accepted = None
        if p.speculative:
            accepted = torch.randint(1, T + 1, (batch,), generator=gen, dtype=torch.int32).to(p.device)
            _sync(p.device)
            t0 = time.perf_counter()
            kernel.commit(state, slots, accepted)
            _sync(p.device)
            report.seconds += time.perf_counter() - t0
        if check:
            rows = torch.arange(batch - pad_rows, device=p.device)
            pick = (accepted[: batch - pad_rows].long() - 1) if accepted is not None else torch.zeros_like(rows)
            for layer, states in enumerate(expected_states):
                want = states[rows, pick]
                got = kernel.read_state(state, real, layer)
                report.max_state_error = max(report.max_state_error, oracle.rel_error(got, want))
                if p.quantized:
                    started = starts[layer][rows] if p.speculative else None
                    worst = oracle.rounding_excess(got, want, p.state_dtype, started).max().item()
                    report.max_rounding = max(report.max_rounding or 0.0, worst)
            report.checked_layer_steps += layers
        if progress is not None:
            progress(step_index + 1)
    for layer, snapshot in enumerate(before):
        after = kernel.read_state(state, untouched, layer)
        report.untouched_checked += len(untouched)
        report.untouched_changed += int((after != snapshot).flatten(1).any(1).sum().item())
    kernel.check()
    report.wall_seconds = time.perf_counter() - wall
    return report
