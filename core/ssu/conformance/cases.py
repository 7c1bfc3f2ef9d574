"""The cases the conformance kit runs: one source for ``ssu verify`` and ``pytest --ssu-backend``.

A :class:`Case` is a problem inside the backend's declared capabilities together with how one of
its steps is called: which optional inputs are given and in which dtypes, whether softplus
applies, where dt lies against softplus's threshold, how the tensors are laid out in memory,
whether ``out`` is passed, the batch, its pad rows and how long a decode runs. :func:`cases`
draws them with hypothesis (each knob independently, so that a bug that needs two of them meets
both); :func:`real_cases` adds real model head shapes as explicit examples, and
:func:`corner_cases` one awkward case per state dtype (heads past a tile, sizes past powers of
two, a large batch with pad rows, a pad id inside the cache). A :class:`Profile` sets how many of
each a check runs.
"""

from __future__ import annotations

from typing import Optional

import attrs

from ..checking.inputs import layer_weights, step_inputs
from ..contract.problem import Problem

#: how a step's tensors sit in memory: as allocated; each row contiguous but the batch and token
#: strides free (slices of a projection, as engines pass them: rows 3 values apart, or 16-byte
#: aligned ones for a backend that declares ``contiguous_rows``); every dimension strided
LAYOUTS = ("contiguous", "rows", "strided")
#: where dt lies: around a trained layer's values; near and past softplus's threshold of 20
DT_RANGES = ("typical", "threshold")
#: real model head shapes (per tensor-parallel rank at tp 1) run as explicit examples
REAL_SHAPES = {
    "nemotron-nano-9b-v2": dict(nheads=128, headdim=80, dstate=128, ngroups=8),
    "nemotron-h-56b": dict(nheads=256, headdim=64, dstate=256, ngroups=8),
    "granite-4.0-h": dict(nheads=128, headdim=64, dstate=128, ngroups=1),
    "dstate-96": dict(nheads=32, headdim=64, dstate=96, ngroups=1),
}
#: head shapes drawn where the backend accepts any (its declared sets otherwise)
NHEADS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48)
HEADDIMS = (1, 4, 5, 8, 16, 32, 64, 80)
DSTATES = (1, 4, 12, 16, 17, 32, 64, 96, 128, 256)


@attrs.frozen
class Profile:
    """How much a conformance run covers.

    ``examples``: problems hypothesis draws per check; ``max_state``: the largest H x P x N it
    draws (real shapes aside); ``real_shapes``: how many of :data:`REAL_SHAPES` run as explicit
    examples of the checks that take them; ``decode_steps``: the length of the decode check
    (``real_decode_steps`` at a real shape); ``max_tokens``: a cap on T below the backend's
    declared maximum (None: T is drawn up to the declared maximum); ``max_slots``, ``max_heads``:
    the largest cache and head count drawn (batches are at most the cache); ``corners``:
    whether the :func:`corner_cases` run after the drawn ones; ``shrink_examples``: how many cases
    shrinking a failure may run before the smallest failure found is reported (the same cases on
    every machine)."""

    name: str
    examples: int
    max_state: int
    real_shapes: int
    decode_steps: int
    real_decode_steps: int
    max_tokens: Optional[int] = None
    max_slots: int = 40
    max_heads: int = 48
    corners: bool = True
    shrink_examples: int = 40


PROFILES = {
    # smoke: for devices where a step is slow (Triton's interpreter on the CPU); T capped at 4,
    # caches at 10 slots and heads at 8, so it is no claim of conformance over the backend's whole declared range
    "smoke": Profile(
        "smoke",
        examples=3,
        max_state=1024,
        real_shapes=0,
        decode_steps=6,
        real_decode_steps=0,
        max_tokens=4,
        max_slots=10,
        max_heads=8,
        corners=False,
    ),
    "quick": Profile("quick", examples=6, max_state=4096, real_shapes=0, decode_steps=12, real_decode_steps=0),
    "default": Profile("default", examples=15, max_state=32768, real_shapes=4, decode_steps=12, real_decode_steps=3),
    "thorough": Profile(
        "thorough",
        examples=80,
        max_state=262144,
        real_shapes=4,
        decode_steps=40,
        real_decode_steps=8,
        shrink_examples=200,
    ),
}


@attrs.frozen
class Case:
    """One problem and how a check calls it (see the module docstring); ``label`` names a real
    shape or a corner case."""

    problem: Problem
    seed: int = 0
    index_dtype: str = "int32"
    layout: str = "contiguous"
    tied: bool = False
    dt_dtype: Optional[str] = None  # None: the input dtype
    D: Optional[str] = "fp32"  # the dtype of D, or None for no D
    dt_bias: Optional[str] = None  # the dtype of dt_bias, or None for no dt_bias
    z: bool = True
    softplus: bool = True
    dt_range: str = "typical"
    out: bool = True
    batch: int = 1
    pad_rows: int = 0
    steps: int = 4
    label: str = ""
    aligned: bool = False  # rows of the "rows" layout 16-byte aligned (``contiguous_rows``)

    def describe(self) -> str:
        """The case in one line: the problem, then every knob that is not at its plainest."""
        p = self.problem
        parts = [p.describe(), f"batch={self.batch}"]
        if self.pad_rows:
            parts.append(f"pad rows={self.pad_rows}")
        parts.append(f"index={self.index_dtype}")
        parts.append(f"layout={self.layout}{' tied' if self.tied else ''}")
        parts.append(f"dt={self.dt_dtype or p.input_dtype} {self.dt_range}")
        parts.append("D=" + (self.D or "none"))
        parts.append("dt_bias=" + (self.dt_bias or "none"))
        parts.append(f"z={'yes' if self.z else 'no'} softplus={'yes' if self.softplus else 'no'}")
        parts.append("out=given" if self.out else "out=None")
        parts.append(f"seed={self.seed}")
        return (f"[{self.label}] " if self.label else "") + " ".join(parts)


# drawing --------------------------------------------------------------------------------------
def _allowed(declared, default) -> list:
    return sorted(declared) if declared is not None else list(default)


def _pad_ids(capabilities, num_slots: int) -> list[int]:
    """Pad ids to draw from: negative ones always; a slot of the cache and ids past its end where
    the backend serves them."""
    ids = [-1, -2, -7, -(2**31) + 1]
    if capabilities.any_pad_slot_id:
        ids += [0, num_slots - 1, num_slots, num_slots + 5]
    return ids


def cases(capabilities, device: str, profile: Profile, *, speculative: Optional[bool] = None):
    """A hypothesis strategy of :class:`Case` inside ``capabilities`` on ``device``.

    ``speculative`` restricts the draw to speculative (True) or one-token (False) problems, for
    checks that apply to one kind only. Every choice shrinks towards its plainest value (first in
    each list), so that a failure is reported on a minimal problem."""
    from hypothesis import strategies as st

    caps = capabilities
    max_tokens = caps.max_tokens_per_step if caps.speculative and speculative is not False else 1
    if profile.max_tokens is not None:
        max_tokens = min(max_tokens, profile.max_tokens)

    @st.composite
    def draw_case(draw):
        N = draw(st.sampled_from(_allowed(caps.dstates, DSTATES)))
        P = draw(st.sampled_from(_allowed(caps.headdims, HEADDIMS)))
        heads = _allowed(caps.nheads, NHEADS)
        fitting = [h for h in heads if h * P * N <= profile.max_state and h <= profile.max_heads] or heads[:1]
        H = draw(st.sampled_from(fitting))
        groups = [g for g in range(1, min(H, 8) + 1) if H % g == 0]
        if caps.ngroups is not None:
            groups = [g for g in groups if g in caps.ngroups] or sorted(caps.ngroups)[:1]
        G = draw(st.sampled_from(groups))
        T = draw(st.integers(1, max_tokens))
        spec = (T > 1 or (caps.speculative and draw(st.booleans()))) if speculative is None else speculative
        num_slots = draw(st.integers(2, profile.max_slots))
        pad = draw(st.sampled_from(_pad_ids(caps, num_slots)))
        state_dtype = draw(st.sampled_from(sorted(caps.state_dtypes, key=_dtype_order)))
        input_dtype = draw(st.sampled_from(sorted(caps.input_dtypes, key=_dtype_order)))
        problem = Problem(
            nheads=H,
            headdim=P,
            dstate=N,
            ngroups=G,
            state_dtype=state_dtype,
            input_dtype=input_dtype,
            num_slots=num_slots,
            max_batch=draw(st.integers(1, num_slots - int(0 <= pad < num_slots))),
            tokens_per_step=T,
            speculative=spec,
            device=device,
            pad_slot_id=pad,
        )
        return draw(_calls(problem, caps, profile.decode_steps))

    return draw_case()


def _dtype_order(name: str) -> tuple:
    """fp32, bf16, fp16 first (the plainest, so a failure shrinks to them), then the rest by name: a
    total order, so that a draw never follows a set's iteration order (which ``PYTHONHASHSEED``
    sets for strings)."""
    return (["fp32", "bf16", "fp16"].index(name) if name in ("fp32", "bf16", "fp16") else 9, name)


def _calls(problem: Problem, caps, steps: int):
    """A strategy of the call knobs of a case for ``problem``."""
    from hypothesis import strategies as st

    @st.composite
    def draw_call(draw):
        inp = problem.input_dtype
        dt_dtype = draw(st.sampled_from([inp, "fp32"] if inp != "fp32" else ["fp32"]))
        weight_dtypes = [inp, "fp32"] if inp != "fp32" else ["fp32"]
        bias_dtypes = [d for d in weight_dtypes if not (caps.dt_bias_as_dt and d == "fp32" and dt_dtype != "fp32")]
        layouts = [x for x in LAYOUTS if not (caps.contiguous_rows and x == "strided")]
        batch = draw(st.integers(1, problem.max_batch))
        return Case(
            problem=problem,
            seed=draw(st.integers(0, 2**31 - 1)),
            index_dtype=draw(st.sampled_from(sorted(caps.index_dtypes))),
            layout=draw(st.sampled_from(layouts)),
            tied=caps.tied_inputs and draw(st.booleans()),
            dt_dtype=dt_dtype,
            D=draw(st.sampled_from(weight_dtypes + [None])),
            dt_bias=draw(st.sampled_from(bias_dtypes + [None])),
            z=draw(st.booleans()),
            softplus=draw(st.booleans()),
            dt_range=draw(st.sampled_from(DT_RANGES)),
            out=draw(st.booleans()),
            batch=batch,
            pad_rows=draw(st.integers(0, min(2, batch - 1))),
            steps=steps,
            aligned=caps.contiguous_rows,
        )

    return draw_call()


def real_cases(capabilities, device: str, profile: Profile, *, speculative: Optional[bool] = None) -> list[Case]:
    """Real model head shapes the backend declares, as explicit cases: every optional input on,
    inputs laid out as engines pass them (rows of a projection), then contiguous and strided in
    turn (where the backend takes them), a batch with a pad row. The state dtypes the backend
    declares take turns over the shapes, and each meets at least one of them (the first shapes
    again where there are more dtypes than shapes)."""
    caps = capabilities
    out = []
    fitting = [
        (label, shape)
        for label, shape in list(REAL_SHAPES.items())[: profile.real_shapes]
        if not any(
            allowed is not None and shape[field] not in allowed
            for field, allowed in (
                ("nheads", caps.nheads),
                ("headdim", caps.headdims),
                ("dstate", caps.dstates),
                ("ngroups", caps.ngroups),
            )
        )
    ]
    states = sorted(caps.state_dtypes, key=_dtype_order)
    if not fitting:
        return out
    turns = [(fitting[i % len(fitting)], states[i % len(states)]) for i in range(max(len(fitting), len(states)))]
    layouts = ["rows", "contiguous"] + ([] if caps.contiguous_rows else ["strided"])
    for (label, shape), state in turns:
        can_speculate = caps.speculative and caps.max_tokens_per_step > 1
        spec = (can_speculate and len(out) % 2 == 1) if speculative is None else speculative
        if spec and not caps.speculative:
            continue
        inp = "bf16" if "bf16" in caps.input_dtypes else sorted(caps.input_dtypes, key=_dtype_order)[0]
        problem = Problem(
            **shape,
            state_dtype=state,
            input_dtype=inp,
            num_slots=4,
            max_batch=3,
            tokens_per_step=min(4, caps.max_tokens_per_step) if spec else 1,
            speculative=spec,
            device=device,
        )
        out.append(
            Case(
                problem,
                seed=len(out),
                layout=layouts[len(out) % len(layouts)],
                dt_bias=inp,
                batch=3,
                pad_rows=1,
                steps=profile.real_decode_steps,
                label=f"{label} {state}",
                aligned=caps.contiguous_rows,
            )
        )
    return out


def _awkward(allowed, limit: int, prefer) -> int:
    """The largest value of ``allowed`` up to ``limit`` that ``prefer`` likes (else the largest up
    to it, else the smallest)."""
    fitting = [v for v in allowed if v <= limit] or [min(allowed)]
    liked = [v for v in fitting if prefer(v)]
    return max(liked or fitting)


def corner_cases(capabilities, device: str, profile: Profile, *, speculative: Optional[bool] = None) -> list[Case]:
    """A case per declared state dtype, one-token and speculative problems taking turns where the
    check takes either (each kind at least once), where tails and bookkeeping go wrong: more than 16 heads
    and not a multiple of 16, head and state sizes past powers of two, two or more groups, a batch
    of up to 16 rows with two pad rows over 24 slots, the pad id inside the cache where the backend
    takes one there (a null block, which an engine leaves holding anything), int64 ids where
    declared, every optional input, strided rows, ``out=None``. Then, at a small shape, a case for
    each pairing of a state dtype and an input dtype those did not meet, so that every pairing the
    backend declares is drawn by construction."""
    caps = capabilities
    odd = lambda v: v & (v - 1) != 0  # noqa: E731 (not a power of two)
    heads = _allowed(caps.nheads, NHEADS)
    H = _awkward(heads, 48, lambda h: h > 16 and h % 16 != 0 and h % 2 == 0)
    N = _awkward(_allowed(caps.dstates, DSTATES), 32, odd)
    P = _awkward(_allowed(caps.headdims, HEADDIMS), 16, odd)
    while H * P * N > profile.max_state and any(h < H for h in heads):
        H = max(h for h in heads if h < H)
    groups = [g for g in range(2, min(H, 8) + 1) if H % g == 0 and (caps.ngroups is None or g in caps.ngroups)]
    G = max(groups) if groups else (min(caps.ngroups) if caps.ngroups else 1)
    if speculative and not caps.speculative:
        return []
    kinds = ([False, True] if caps.speculative else [False]) if speculative is None else [speculative]
    num_slots = 24
    pad = 0 if caps.any_pad_slot_id else -1
    inp = "bf16" if "bf16" in caps.input_dtypes else sorted(caps.input_dtypes, key=_dtype_order)[0]
    out = []
    # what every corner case shares: rows strided (16-byte aligned ones where the backend needs them)
    shared = dict(layout="rows" if caps.contiguous_rows else "strided", steps=min(profile.decode_steps, 4),
                  aligned=caps.contiguous_rows)  # fmt: skip
    states = sorted(caps.state_dtypes, key=_dtype_order)
    for i in range(max(len(states), len(kinds))):  # the dtypes take turns over the kinds
        state, spec = states[i % len(states)], kinds[i % len(kinds)]
        T = min(3, caps.max_tokens_per_step, profile.max_tokens or 3) if spec else 1
        problem = Problem(
            nheads=H, headdim=P, dstate=N, ngroups=G, state_dtype=state, input_dtype=inp, num_slots=num_slots,
            max_batch=16, tokens_per_step=T, speculative=spec, device=device,
            pad_slot_id=pad,
        )  # fmt: skip
        out.append(
            Case(
                problem,
                seed=1000 + len(out),
                index_dtype="int64" if "int64" in caps.index_dtypes else sorted(caps.index_dtypes)[0],
                dt_bias=inp,
                D=inp,
                out=False,
                batch=16,
                pad_rows=2,
                label=f"corner {state}{' T=' + str(T) if spec else ''}",
                **shared,
            )
        )
    met = {(c.problem.state_dtype, c.problem.input_dtype) for c in out}
    pairs = [(s, i) for s in states for i in sorted(caps.input_dtypes, key=_dtype_order) if (s, i) not in met]
    h = min(heads)
    small = dict(nheads=h, headdim=min(_allowed(caps.headdims, HEADDIMS)), dstate=min(_allowed(caps.dstates, DSTATES)),
                 ngroups=1 if caps.ngroups is None or 1 in caps.ngroups else min(caps.ngroups))  # fmt: skip
    for state, inp in pairs:
        spec = kinds[len(out) % len(kinds)]
        T = min(3, caps.max_tokens_per_step, profile.max_tokens or 3) if spec else 1
        problem = Problem(**small, state_dtype=state, input_dtype=inp, num_slots=8, max_batch=4, tokens_per_step=T,
                          speculative=spec, device=device, pad_slot_id=pad)  # fmt: skip
        out.append(
            Case(
                problem,
                seed=1000 + len(out),
                dt_bias=inp,
                batch=4,
                pad_rows=1,
                label=f"corner {state} x {inp}",
                **shared,
            )  # fmt: skip
        )
    return out


# a case's tensors -----------------------------------------------------------------------------
def weights(case: Case, gen) -> dict:
    """A, D and dt_bias of one layer for ``case`` (D and dt_bias in their drawn dtypes, or None).
    Without softplus dt_bias is small and positive, so that dt + dt_bias stays a time step (a
    negative one would grow the state without bound over a long decode)."""
    w = layer_weights(
        case.problem,
        gen,
        with_D=case.D is not None,
        with_dt_bias=case.dt_bias is not None,
        D_dtype=case.D or "fp32",
        dt_bias_dtype=case.dt_bias,
    )
    if w["dt_bias"] is not None and not case.softplus:
        w["dt_bias"] = (w["dt_bias"].float().abs() * 0.02 + 0.01).to(w["dt_bias"].dtype)
    return w


def step_call(case: Case, slots, gen, layer_weights_: Optional[dict] = None, *, tokens: Optional[int] = None):
    """One step's inputs for ``case``: (what the oracle reads, the keyword arguments of the step
    call). Both hold the same numbers; the call's tensors are laid out as ``case.layout`` (and
    tied when ``case.tied``), with ``out`` a NaN-filled tensor when ``case.out``, laid out like x
    (but one contiguous block for a backend that needs ``contiguous_rows``, ``case.aligned``)."""
    import torch

    from ..contract.dtypes import to_torch

    p = case.problem
    w = weights(case, gen) if layer_weights_ is None else layer_weights_
    inputs = step_inputs(p, slots, gen, tokens=tokens, weights=w, with_z=case.z, dt_softplus=case.softplus)
    dt = inputs.dt.float()
    if case.dt_range == "threshold":  # near softplus's threshold (19..21) and past it (up to 40)
        near = torch.rand(dt.shape, generator=gen) < 0.5
        dt = torch.where(
            near, 19.0 + 2.0 * torch.rand(dt.shape, generator=gen), 14.0 + 26.0 * torch.rand(dt.shape, generator=gen)
        )
    dt = dt.to(to_torch(case.dt_dtype or p.input_dtype)).to(p.device)
    inputs = attrs.evolve(inputs, dt=dt)
    call = {k: _laid_out(v, case.layout, _lead(p, k), aligned=case.aligned) for k, v in inputs.kwargs().items()}
    if case.tied:
        call = _tied(call, p)
    if case.out:  # laid out as x is (one contiguous block where the backend declares contiguous_rows)
        nan = torch.full_like(inputs.x, float("nan"))
        call["out"] = _laid_out(nan, "contiguous" if case.aligned else case.layout, _lead(p, "x"))
    else:
        call["out"] = None
    return inputs, call


def _lead(problem: Problem, name: str) -> int:
    """How many leading (batch, token) dimensions a step input has; -1 for what is not laid out."""
    if name in ("x", "dt", "B", "C", "z"):
        return 2 if problem.multi_token else 1
    if name in ("A", "D", "dt_bias"):
        return 0
    return -1


def _laid_out(t, layout: str, lead: int, *, aligned: bool = False):
    """``t``'s values in a tensor of ``layout`` (see :data:`LAYOUTS`,
    :func:`ssu.checking.call_layouts.laid_out`); the per-head parameters (``lead`` 0) keep their own
    layout in "rows", and what is not laid out (``lead`` -1) stays as it is."""
    import torch

    from ..checking.call_layouts import laid_out

    if not isinstance(t, torch.Tensor) or lead < 0 or (layout == "rows" and lead == 0):
        return t
    return laid_out(t, layout, lead, aligned=aligned)


def _tied(call: dict, problem: Problem) -> dict:
    """dt, A, D and dt_bias in Mamba2's expanded form: stride 0 along P (and N)."""
    P, N = problem.headdim, problem.dstate
    out = dict(call)
    out["dt"] = call["dt"].unsqueeze(-1).expand(*call["dt"].shape, P)
    out["A"] = call["A"][:, None, None].expand(-1, P, N)
    for name in ("D", "dt_bias"):
        if call[name] is not None:
            out[name] = call[name][:, None].expand(-1, P)
    return out
