"""What the conformance kit draws (docs/kit-rules.md, "What the kit draws"): at the default profile
every value of every knob of every call form is drawn, for a backend declaring every capability
and for narrower ones, and the page's table is the one the kit's own strategies give."""

from __future__ import annotations

import os
import sys

import attrs
import pytest
import torch

from ssu.conformance import coverage, engine_draws
from ssu.conformance.cases import PROFILES
from ssu.plugins.registry import default_registry

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = PROFILES["default"]


def _reference_caps():
    return default_registry().load("reference").spec.capabilities


def _narrow_caps():
    """A backend declaring less: rows contiguous, int32 ids only, no expanded parameters, an
    fp32 dt_bias refused with a narrower dt, verify without tree."""
    return attrs.evolve(
        _reference_caps(), contiguous_rows=True, index_dtypes=frozenset({"int32"}), tied_inputs=False,
        dt_bias_as_dt=True, engine_calls=frozenset({"packed", "verify"}),
    )  # fmt: skip


@pytest.mark.parametrize("caps", [_reference_caps, _narrow_caps], ids=["every-capability", "narrower"])
def test_the_engine_forms_draw_every_cell_at_the_default_profile(caps):
    assert coverage.missing_engine_cells(caps(), "cpu", DEFAULT) == []


@pytest.mark.parametrize("check", ["step", "decode", "destinations"])
def test_the_step_forms_draw_every_cell_at_the_default_profile(check):
    assert coverage.missing_step_cells(_reference_caps(), "cpu", DEFAULT, check) == []


@pytest.mark.parametrize("seed", range(12))
def test_a_schedule_covers_every_value_whatever_the_seed(seed):
    """By construction: each case's calls hold every value of every knob, for any generator."""
    import ssu

    caps = _reference_caps()
    for state in ("fp32", "bf16", "int8"):
        p = ssu.Problem(
            nheads=3, headdim=2, dstate=5, ngroups=1, state_dtype=state, input_dtype="fp16", num_slots=30,
            max_batch=3, tokens_per_step=3, engine_calls={"packed", "verify", "tree"},
        )  # fmt: skip
        for axes in (engine_draws.packed_axes(caps, p), engine_draws.verify_axes(caps, p)):
            calls = engine_draws.covering(axes, torch.Generator().manual_seed(seed))
            drawn = {(a, v) for call in calls for a, v in call.items()}
            assert {(a.name, v) for a in axes for v in a.values} <= drawn
            for call in calls:  # and every call keeps the knobs' conditions
                chosen = {}
                for axis in axes:
                    assert axis.allowed(call[axis.name], chosen), (axis.name, call)
                    chosen[axis.name] = call[axis.name]


def test_the_rules_page_shows_what_the_kit_draws():
    sys.path.insert(0, os.path.join(HERE, "mutation"))
    import rules_table

    with open(rules_table.PAGE) as f:
        page = f.read()
    section = rules_table.coverage_section()
    assert page.endswith(section), "docs/kit-rules.md: rewrite it with tests/mutation/rules_table.py"
