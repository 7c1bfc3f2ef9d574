"""What the kit draws of the engines' call forms (docs/spec.md, "Engine call forms"): each knob of
a call (an argument's layout, an optional argument given or not, a dtype pairing) as an axis of
values, and a covering schedule that puts every value of every axis the backend's capabilities
allow into some call of every case.

Coverage holds by construction: :func:`covering` returns calls until no allowed value of any axis
is left out, whatever the case's seed, so a check running a case's schedule draws every cell of
:func:`coverage_table` that the case's problem allows (the state dtype of a buffer pairing comes
from the case). The table in docs/kit-rules.md is generated from here.
"""

from __future__ import annotations

from typing import Callable, Optional

import attrs

from ..checking.call_layouts import BUFFER_LAYOUTS, INPUT_LAYOUTS, TABLE_LAYOUTS


@attrs.frozen
class Axis:
    """One knob of an engine call: its ``values``, what it is (``says``), and ``when`` a value
    applies given the values chosen for the axes before it (None: always)."""

    name: str
    values: tuple
    says: str
    when: Optional[Callable[[str, dict], bool]] = None
    requires: str = ""  # in words, for the table: when the values past the first apply

    def allowed(self, value: str, chosen: dict) -> bool:
        return self.when is None or self.when(value, chosen)


def _dtypes(caps, problem) -> tuple:
    inp = problem.input_dtype
    return (inp, "fp32") if inp != "fp32" else ("fp32",)


def _bias_ok(caps, problem):
    def when(value: str, chosen: dict) -> bool:  # dt_bias_as_dt: an fp32 bias with a narrower dt is refused
        return not (caps.dt_bias_as_dt and value == "fp32" and chosen.get("dt") != "fp32")

    return when


def _shared_axes(caps, problem) -> list[Axis]:
    """The knobs both forms share: index dtype, input layout, output, per-head parameters and the
    optional inputs."""
    weights = _dtypes(caps, problem)
    layouts = tuple(v for v in INPUT_LAYOUTS if not (caps.contiguous_rows and v == "strided"))
    return [
        Axis("index dtype", tuple(sorted(caps.index_dtypes)), "slots and tables: int32 or int64"),
        Axis(
            "inputs",
            layouts,
            "x, dt, B, C, z (and a given out, one contiguous block where the backend declares contiguous_rows): "
            "as allocated; rows of a wider projection; every dimension strided (not with contiguous_rows)",
        ),  # fmt: skip
        Axis("out", ("given", "none"), "out given (NaN-filled, written in place and returned) or allocated"),
        Axis(
            "per-head",
            ("(H,)", "expanded") if caps.tied_inputs else ("(H,)",),
            "dt, A, D, dt_bias per head, or expanded over P and N with stride 0 (tied_inputs)",
        ),  # fmt: skip
        Axis("dt", weights, "dt in x's dtype or fp32"),
        Axis("D", weights + ("none",), "D in fp32 or x's dtype, or not given"),
        Axis(
            "dt_bias",
            weights + ("none",),
            "dt_bias in fp32 or x's dtype, or not given",
            when=_bias_ok(caps, problem),
            requires="an fp32 dt_bias with a narrower dt: not where the backend declares dt_bias_as_dt",
        ),  # fmt: skip
        Axis("z", ("given", "none"), "the gate z given or not"),
        Axis("softplus", ("yes", "no"), "dt_softplus set or not"),
    ]


def _other_layout(value: str, chosen: dict) -> bool:  # two tables' strides never taken for each other's
    return value == "none" or value != chosen["slot table"]


def packed_axes(caps, problem) -> list[Axis]:
    """The knobs of a ``packed`` call, in the order they are chosen."""

    def with_offsets(value: str, chosen: dict) -> bool:  # rows to spare: tokens stay within N x W
        return value == "none" or (
            chosen["offsets"] == "given" and chosen["out"] == "given" and chosen["lengths"] != "every sequence full"
        )

    def with_offsets_only(value: str, chosen: dict) -> bool:
        return value == "random" or chosen["offsets"] == "given"

    return [
        Axis("offsets", ("given", "none"), "cu_seqlens given, or one token a sequence"),
        Axis("counts", ("given", "none"), "num_accepted given or not (with and without offsets)"),
        Axis("slot table", TABLE_LAYOUTS, "the slot table as allocated, a strided view, transposed"),
        Axis(
            "dst_slots",
            ("none",) + TABLE_LAYOUTS,
            "the slot table as both, or a destination table of its own in a layout other than the slot table's",
            when=_other_layout,
            requires="its layout differs from the slot table's",
        ),  # fmt: skip
        *_shared_axes(caps, problem),
        Axis(
            "lengths",
            ("random", "an empty sequence", "every sequence full"),
            "tokens per sequence: 0 to W at random, one sequence of none, W each",
            when=with_offsets_only,
            requires="offsets",
        ),  # fmt: skip
        Axis(
            "unowned rows",
            ("none", "leading", "trailing"),
            "rows of out no sequence owns: before the first offset, after the last",
            when=with_offsets,
            requires="offsets, a given out, room in the tables",
        ),  # fmt: skip
        Axis("padded sequence", ("yes", "no"), "a sequence whose start cell is the pad id"),
        Axis("pad cells", ("yes", "no"), "destination cells holding the pad id"),
    ]


def verify_axes(caps, problem) -> list[Axis]:
    """The knobs of a ``verify`` call (``tree`` calls among them where the backend serves it)."""
    tree = "tree" in caps.engine_calls
    buffers = ("none", "fp32", "bf16", "fp16")

    def with_buffer(default: str):
        def when(value: str, chosen: dict) -> bool:
            return chosen["buffer"] != "none" or value == default

        return when

    def with_parents(value: str, chosen: dict) -> bool:
        return chosen["parents"] != "none" or value == "contiguous"

    def parents_need_buffer(value: str, chosen: dict) -> bool:
        return value == "none" or chosen["buffer"] != "none"

    return [
        Axis(
            "buffer", buffers, "no intermediate-state buffer, or one in fp32, bf16 or fp16 (whatever the cache's dtype)"
        ),  # fmt: skip
        Axis(
            "buffer layout",
            BUFFER_LAYOUTS,
            "the buffer as allocated, or with row and step strides of its own",
            when=with_buffer("contiguous"),
            requires="a buffer",
        ),  # fmt: skip
        Axis(
            "buffer_rows",
            ("given", "slots"),
            "buffer rows given, or the slots (the default)",
            when=with_buffer("slots"),
            requires="a buffer",
        ),  # fmt: skip
        Axis(
            "steps",
            ("T", "T + 2"),
            "buffer steps: as many as the tokens, or more (steps past T not written)",
            when=with_buffer("T"),
            requires="a buffer",
        ),  # fmt: skip
        Axis(
            "parents",
            ("none", "given") if tree else ("none",),
            "a parent table (tree) or none",
            when=parents_need_buffer,
            requires="a buffer; the backend serves tree",
        ),  # fmt: skip
        Axis(
            "parents layout",
            TABLE_LAYOUTS if tree else ("contiguous",),
            "the parent table as allocated, a strided view, transposed",
            when=with_parents,
            requires="parents",
        ),  # fmt: skip
        Axis("update_state", ("yes", "no"), "the last state written to the slot, or the cache left as it was"),
        *_shared_axes(caps, problem),
        Axis("pad rows", ("yes", "no"), "rows whose slot is the pad id"),
    ]


def covering(axes: list[Axis], gen, *, tries: int = 24) -> list[dict]:
    """Calls (axis name -> value) that together hold every value of every axis that some call
    can hold, each call's other values drawn from ``gen``: greedy, each call the best of ``tries``
    random completions that prefer values not yet drawn; a value none of them reaches gets a call
    of its own, found by search over the axes before it (their conditions allowing it)."""
    import torch

    missing = {(a.name, v) for a in axes for v in a.values}
    calls: list[dict] = []

    def pick(options: list):
        return options[int(torch.randint(0, len(options), (1,), generator=gen))]

    def completed(chosen: dict, start: int, lean: float = 1.0) -> dict:
        """``chosen`` with values for axes ``start`` on: one not yet drawn where there is one
        (with probability ``lean``), else any the conditions allow."""
        for axis in axes[start:]:
            options = [v for v in axis.values if axis.allowed(v, chosen)]
            fresh = [v for v in options if (axis.name, v) in missing]
            prefer = fresh if fresh and (lean >= 1.0 or float(torch.rand(1, generator=gen)) < lean) else options
            chosen[axis.name] = pick(prefer)
        return chosen

    def reaching(target: int, value: str, chosen: dict, i: int) -> Optional[dict]:
        """``chosen`` extended over axes ``i..target - 1`` so that axis ``target`` allows ``value``."""
        if i == target:
            return dict(chosen, **{axes[i].name: value}) if axes[i].allowed(value, chosen) else None
        options = [v for v in axes[i].values if axes[i].allowed(v, chosen)]
        order = torch.randperm(len(options), generator=gen).tolist()
        for k in order:
            found = reaching(target, value, dict(chosen, **{axes[i].name: options[k]}), i + 1)
            if found is not None:
                return found
        return None

    while missing:
        best, gained = None, set()
        for _ in range(tries):
            chosen = completed({}, 0, lean=0.85)
            new = set(chosen.items()) & missing
            if len(new) > len(gained):
                best, gained = chosen, new
        if not gained:
            index = {a.name: i for i, a in enumerate(axes)}
            name, value = min(missing, key=lambda cell: (index[cell[0]], cell[1]))
            found = reaching(index[name], value, {}, 0)
            if found is None:  # no call can hold it: its conditions never allow it
                missing.discard((name, value))
                continue
            best = completed(found, index[name] + 1)
            gained = set(best.items()) & missing
        calls.append(best)
        missing -= gained
    return calls


def coverage_table(caps, problem) -> list[tuple[str, str, str, str, str]]:
    """(form, axis, values, what, when) rows: every cell a case of ``problem`` draws for a backend
    of ``caps``."""
    rows = []
    forms = [("packed", packed_axes)] if "packed" in caps.engine_calls else []
    if "verify" in caps.engine_calls:
        forms.append(("verify" + (", tree" if "tree" in caps.engine_calls else ""), verify_axes))
    for form, axes in forms:
        for axis in axes(caps, problem):
            rows.append((form, axis.name, ", ".join(axis.values), axis.says, axis.requires))
    return rows
