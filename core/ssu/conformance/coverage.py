"""What the kit draws, as a table of cells: every knob of every call form (an argument's layout, an
optional argument given or not, a dtype or dtype pairing) and the values the spec allows it, and
which of them a run at a profile reaches.

:func:`drawn_cases` replays the cases a check runs (the same hypothesis draws as
:func:`.runner.run_check`, then the real shapes and corners) without running a backend, so the
table can be checked against what a run draws; :func:`markdown` is the table docs/kit-rules.md
carries. The engine call forms reach every cell by construction (:mod:`.engine_draws`); the
one-token and speculative step forms by the case strategy's draws, which the repository's tests
hold to the table at the default profile.
"""

from __future__ import annotations

import zlib
from typing import Optional

from . import engine_draws
from .cases import DT_RANGES, LAYOUTS, Case, cases, corner_cases, real_cases
from .engine_calls import MAX_TOKENS


def drawn_cases(check: str, capabilities, device: str, profile) -> list[Case]:
    """The cases ``run_check`` runs for ``check`` on a backend of ``capabilities`` that accepts
    every problem inside them and passes: hypothesis' draws under the check's own seed and the
    runner's settings, then the real shapes and corners."""
    from hypothesis import HealthCheck, given, seed, settings

    from .catalogue import CHECKS

    spec = CHECKS[check]
    seen: list[Case] = []

    def record(case: Case) -> None:
        seen.append(case)

    test = given(case=cases(capabilities, device, profile, speculative=spec.speculative))(record)
    test = seed(zlib.crc32(check.encode()))(test)
    test = settings(max_examples=profile.examples, derandomize=False, deadline=None, database=None,
                    report_multiple_bugs=False, suppress_health_check=list(HealthCheck))(test)  # fmt: skip
    test()
    if spec.real_shapes:
        seen += real_cases(capabilities, device, profile, speculative=spec.speculative)
    if profile.corners:
        seen += corner_cases(capabilities, device, profile, speculative=spec.speculative)
    return seen


#: the step inputs a case lays out, each drawn in every layout the backend takes
LAID_OUT = ("x", "dt", "B", "C", "z", "out")


def step_axes(caps) -> dict[str, tuple]:
    """The knobs of a one-token or speculative step the kit's cases set, and the values each may
    take for a backend of ``caps``: one row per argument's layout (``out`` one contiguous block
    where the backend declares ``contiguous_rows``), per optional argument, per dtype."""
    layouts = tuple(v for v in LAYOUTS if not (caps.contiguous_rows and v == "strided"))
    axes = {
        "tokens": ("one", "several") if caps.speculative and caps.max_tokens_per_step > 1 else ("one",),
        "state dtype": tuple(sorted(caps.state_dtypes)),
        "input dtype": tuple(sorted(caps.input_dtypes)),
        "state x input": tuple(f"{s} x {i}" for s in sorted(caps.state_dtypes) for i in sorted(caps.input_dtypes)),
        "index dtype": tuple(sorted(caps.index_dtypes)),
    }
    for name in LAID_OUT:
        axes[f"{name} layout"] = ("contiguous",) if name == "out" and caps.contiguous_rows else layouts
    axes.update({
        "per-head": ("(H,)", "expanded") if caps.tied_inputs else ("(H,)",),
        "dt": ("x's dtype", "fp32 with a narrower x"),
        "D": ("fp32", "x's dtype", "none"),
        "dt_bias": ("fp32", "x's dtype", "none"),
        "dt range": DT_RANGES,
        "z": ("given", "none"),
        "softplus": ("yes", "no"),
        "out": ("given", "none"),
        "pad rows": ("yes", "no"),
        "pad id": ("negative", "past the cache", "a slot of the cache") if caps.any_pad_slot_id else ("negative",),
    })  # fmt: skip
    return axes


def commit_axes(caps) -> dict[str, tuple]:
    """The knobs of a commit (after a speculative step of the ``step`` and ``decode`` checks):
    which counts its rows keep (:func:`.expect.draw_accepted` gives the first rows T, 1 and one
    between, by construction), pad rows, the index dtype."""
    if not caps.speculative or caps.max_tokens_per_step < 2:
        return {}
    counts = ("T", "1", "between") if caps.max_tokens_per_step > 2 else ("T", "1")
    return {"counts": counts, "pad rows": ("yes", "no"), "index dtype": tuple(sorted(caps.index_dtypes))}


def destination_axes(caps) -> dict[str, tuple]:
    """The knobs of a step with ``dst_slots`` (the ``destinations`` check): what a row's
    destination is, a pad row with a real destination, the index dtype."""
    if not caps.destination_slots:
        return {}
    return {
        "destination": ("a slot no row reads", "the pad id", "outside the cache"),
        "pad row, real destination": ("yes", "no"),
        "index dtype": tuple(sorted(caps.index_dtypes)),
    }


def step_cells(case: Case) -> set:
    """The (knob, value) cells of :func:`step_axes` that ``case`` sets."""
    p = case.problem
    narrower = p.input_dtype != "fp32"

    def weight(dtype: Optional[str]) -> str:  # "x's dtype": one narrower than fp32
        return "none" if dtype is None else "fp32" if dtype == "fp32" else "x's dtype"

    pad = p.pad_slot_id
    given = {"z": case.z, "out": case.out}
    cells = {
        (f"{name} layout", "contiguous" if name == "out" and case.aligned else case.layout)
        for name in LAID_OUT
        if given.get(name, True)
    }
    return cells | {
        ("tokens", "several" if p.tokens_per_step > 1 else "one"),
        ("state dtype", p.state_dtype),
        ("input dtype", p.input_dtype),
        ("state x input", f"{p.state_dtype} x {p.input_dtype}"),
        ("index dtype", case.index_dtype),
        ("per-head", "expanded" if case.tied else "(H,)"),
        ("dt", "fp32 with a narrower x" if narrower and (case.dt_dtype or p.input_dtype) == "fp32" else "x's dtype"),
        ("D", weight(case.D)),
        ("dt_bias", weight(case.dt_bias)),
        ("dt range", case.dt_range),
        ("z", "given" if case.z else "none"),
        ("softplus", "yes" if case.softplus else "no"),
        ("out", "given" if case.out else "none"),
        ("pad rows", "yes" if case.pad_rows else "no"),
        ("pad id", "negative" if pad < 0 else "past the cache" if pad >= p.num_slots else "a slot of the cache"),
    }


def commit_cells(case: Case) -> set:
    """The cells of :func:`commit_axes` the commit of ``case`` reaches."""
    p = case.problem
    if not p.speculative:
        return set()
    real, T = case.batch - case.pad_rows, p.tokens_per_step
    counts = {"T"} | ({"1"} if real >= 2 else set()) | ({"between"} if real >= 3 and T > 2 else set())
    cells = {("counts", c) for c in counts if real >= 1}
    return cells | {("pad rows", "yes" if case.pad_rows else "no"), ("index dtype", case.index_dtype)}


def destination_cells(case: Case) -> set:
    """The cells of :func:`destination_axes` that the ``destinations`` check reaches on ``case``
    (a kernel with validation on, as the kit opens them)."""
    from ..checking.harness import real_slots

    p = case.problem
    b = min(case.batch, len(real_slots(p)) // 2)
    if b < 1:
        return set()
    pad = min(case.pad_rows, b - 1)
    spare = len(real_slots(p)) - 2 * (b - pad) + (1 if b - pad >= 3 else 0) > 0
    cells = {
        ("destination", "a slot no row reads"),
        ("destination", "outside the cache"),
        ("index dtype", case.index_dtype),
        ("pad row, real destination", "yes" if pad and spare else "no"),
    }
    if b - pad >= 3:
        cells.add(("destination", "the pad id"))
    return cells


#: check -> (the axes of what its cases draw, the cells a case reaches)
TABLES = {
    "step": ((step_axes, step_cells), (commit_axes, commit_cells)),
    "decode": ((step_axes, step_cells), (commit_axes, commit_cells)),
    "destinations": ((destination_axes, destination_cells),),
}


def missing_step_cells(capabilities, device: str, profile, check: str = "step") -> list[tuple]:
    """The cells of the step forms (:data:`TABLES`: the step's knobs, and the commit's or the
    destinations') no case of ``check`` reaches at ``profile``, each as (table, knob, value)."""
    drawn = drawn_cases(check, capabilities, device, profile)
    missing = set()
    for axes, cells in TABLES[check]:
        reached = set()
        for case in drawn:
            reached |= cells(case)
        table = axes.__name__.removesuffix("_axes")
        missing |= {(table, a, v) for a, values in axes(capabilities).items() for v in values} - {
            (table, a, v) for a, v in reached
        }
    return sorted(missing)


def missing_engine_cells(capabilities, device: str, profile) -> list[tuple]:
    """Cells of the engine call forms no case reaches at ``profile``: each case's schedule
    (:func:`.engine_draws.covering`) against every value of every axis, and the buffer dtype
    pairings (the cache's state dtype, from the cases, with each buffer dtype)."""
    import attrs
    import torch

    missing = set()
    pairs = set()
    for check, form, axes in (("packed-calls", "packed", engine_draws.packed_axes),
                              ("verify-calls", "verify", engine_draws.verify_axes)):  # fmt: skip
        if form not in capabilities.engine_calls:
            continue
        for case in drawn_cases(check, capabilities, device, profile):
            W = max(1, min(MAX_TOKENS, capabilities.max_tokens_per_step))  # as the checks open their kernels
            calls = {"packed"} if form == "packed" else {"verify", "tree"} & capabilities.engine_calls
            problem = attrs.evolve(case.problem, tokens_per_step=W, speculative=False, engine_calls=calls)
            drawn = axes(capabilities, problem)
            schedule = engine_draws.covering(drawn, torch.Generator().manual_seed(case.seed))
            reached = {(a, v) for call in schedule for a, v in call.items()}
            missing |= {(form, a.name, v) for a in drawn for v in a.values} - {(form, a, v) for a, v in reached}
            if form == "verify":
                pairs |= {(case.problem.state_dtype, call["buffer"]) for call in schedule}
    for state in capabilities.state_dtypes if "verify" in capabilities.engine_calls else ():
        for buffer in ("none", "fp32", "bf16", "fp16"):
            if (state, buffer) not in pairs:
                missing.add(("verify", "cache x buffer", f"{state} x {buffer}"))
    return sorted(missing)


def markdown(capabilities) -> str:
    """The table of cells for a backend of ``capabilities`` (docs/kit-rules.md shows the one for a
    backend that declares everything: the reference's)."""
    from ..contract.problem import Problem

    lines = [
        "| form | knob | values | what | applies when |",
        "|---|---|---|---|---|",
    ]
    for axis, values in step_axes(capabilities).items():
        lines.append(f"| step (one token, speculative) | {axis} | {', '.join(values)} |  |  |")
    for axis, values in commit_axes(capabilities).items():
        lines.append(f"| commit | {axis} | {', '.join(values)} |  | a speculative step |")
    for axis, values in destination_axes(capabilities).items():
        lines.append(f"| step with dst_slots | {axis} | {', '.join(values)} |  | destination_slots |")
    probe = Problem(
        nheads=2, headdim=2, dstate=2, ngroups=1, state_dtype="bf16", input_dtype="bf16", num_slots=8, max_batch=2,
        tokens_per_step=2, engine_calls=capabilities.engine_calls,
    )  # fmt: skip
    for form, axis, values, says, when in engine_draws.coverage_table(capabilities, probe):
        lines.append(f"| {form} | {axis} | {values.replace('bf16, fp32', 'x dtype, fp32')} | {says} | {when} |")
    if "verify" in capabilities.engine_calls:
        states = ", ".join(sorted(capabilities.state_dtypes))
        lines.append(f"| verify | cache x buffer | every state dtype ({states}) with every buffer | "
                     "the buffer's dtype whatever the cache's |  |")  # fmt: skip
    return "\n".join(lines) + "\n"
