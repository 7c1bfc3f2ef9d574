"""The conformance kit against mutants of an independently written backend.

- the ``independent`` backend passes the kit at the default profile (and imports none of ssu's
  own implementation);
- each mutant's ``SHOWN_BY`` call gives a result that differs from the base's beyond every error
  budget, while the base agrees there with the reference backend: the mutant is wrong, shown
  without the kit;
- the kit at its default settings fails every mutant, through ``ssu.testing.assert_conformant``
  and through ``ssu.conformance.run_conformance`` (what ``ssu verify`` runs), in one run;
- every rule of ``ssu.conformance.rules.RULES`` is broken by at least one mutant, and every mutant overrides
  exactly one method.
"""

from __future__ import annotations

import ast
import inspect
import os

import pytest

import demos
import rules_table
import ssu.conformance
import sweep
from independent import Deferred, Independent
from mutants import MUTANTS, Mutant
from ssu.conformance.rules import RULES
from ssu.testing import assert_conformant

BASE = Independent.NAME
HERE = os.path.dirname(os.path.abspath(__file__))
#: ssu's own implementation, which the independent backend must not use
FORBIDDEN = ("ssu.reference", "ssu.state.slot_state", "ssu.state.quant", "ssu.checking", "ssu.state.slot_kernels",
             "ssu.state.faults", "ssu.conformance")  # fmt: skip


@pytest.fixture(scope="module")
def registry():
    """The reference, the independent backend and every mutant, each under its own name."""
    return demos.registry_with(Independent(), Deferred(), *[mutant() for mutant in MUTANTS])


def _kit(name: str, registry, monkeypatch):
    """``assert_conformant(name)`` at the default profile: (the AssertionError it raised or None,
    the reports of the ``run_conformance`` call it made, which is what ``ssu verify`` prints)."""
    seen = []
    original = ssu.conformance.run_conformance

    def recording(*args, **kwargs):
        reports = original(*args, **kwargs)
        seen.extend(reports)
        return reports

    monkeypatch.setattr(ssu.conformance, "run_conformance", recording)
    try:
        assert_conformant(name, registry=registry)
    except AssertionError as exc:
        return exc, seen
    return None, seen


# the base ---------------------------------------------------------------------------------------
def test_the_independent_backend_uses_none_of_ssus_implementation():
    with open(os.path.join(HERE, "independent.py")) as f:
        tree = ast.parse(f.read())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    used = sorted(m for m in imported if m.startswith(FORBIDDEN))
    assert not used, f"independent.py imports {used}"


@pytest.mark.slow
def test_the_independent_backend_passes_the_kit(registry, monkeypatch):
    error, reports = _kit(BASE, registry, monkeypatch)
    assert error is None, str(error)
    assert {r.check: r.status for r in reports} == {
        name: ("skip" if name == "cuda-graph" else "pass") for name in ssu.conformance.CHECK_NAMES
    }


@pytest.mark.slow
def test_the_deferred_backend_passes_the_kit(registry, monkeypatch):
    """The base of the deferred-commit mutants keeps the contract: its mutants are wrong, not it."""
    error, reports = _kit(Deferred.NAME, registry, monkeypatch)
    assert error is None, str(error)
    assert {r.check for r in reports if r.status == "fail"} == set()


_DEFERRED = [m for m in MUTANTS if issubclass(m, Deferred)]


@pytest.mark.parametrize("mutant", _DEFERRED, ids=lambda m: m.__name__)
def test_the_deferred_backend_agrees_with_the_independent_one(mutant, registry):
    """On each demonstration of a deferred-commit mutant, its base gives what ``independent`` gives."""
    deferred = demos.outcome(mutant.SHOWN_BY, registry, Deferred.NAME)
    assert not isinstance(deferred, str), deferred
    assert not demos.differs(deferred, demos.outcome(mutant.SHOWN_BY, registry, BASE))


# each mutant shown wrong without the kit ----------------------------------------------------------
@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.__name__)
def test_each_mutant_is_shown_wrong(mutant, registry):
    base = demos.outcome(mutant.SHOWN_BY, registry, BASE)
    assert not isinstance(base, str), f"the base failed its own demonstration: {base}"
    got = demos.outcome(mutant.SHOWN_BY, registry, mutant.NAME)
    assert demos.differs(got, base), f"{mutant.__name__}: {mutant.SHOWN_BY.__doc__} gives the base's result"


_SCENARIOS = list({m.SHOWN_BY.__doc__ or m.SHOWN_BY.__name__: m for m in MUTANTS}.values())


@pytest.mark.parametrize("mutant", _SCENARIOS, ids=lambda m: m.SHOWN_BY.__doc__ or m.SHOWN_BY.__name__)
def test_the_base_agrees_with_the_reference_on_each_demonstration(mutant, registry):
    """The base's side of each demonstration is right: the reference backend gives the same."""
    base = demos.outcome(mutant.SHOWN_BY, registry, BASE)
    reference = demos.outcome(mutant.SHOWN_BY, registry, "reference")
    assert not demos.differs(base, reference), f"{mutant.SHOWN_BY.__doc__}: independent and reference differ"


# the kit fails each mutant ------------------------------------------------------------------------
@pytest.mark.slow
def test_the_kit_fails_every_mutant_in_the_first_check_the_rules_page_names():
    """Each mutant through ``assert_conformant`` at the default profile, in two processes, on the
    first check docs/kit-rules.md lists for it (each check draws the same cases alone as in a whole
    run, so this is a failure a whole run has; ``sweep.py`` runs every check and writes the page):
    it raises, the report (what ``ssu verify`` prints) fails in that check, and the failure names a
    rule and a case."""
    listed = rules_table.read_table()
    by_class = {m.__name__: m for m in MUTANTS}
    results = sweep.run_all(list(by_class), checks=lambda n: listed[by_class[n].NAME][1][:1])
    wrong = []
    for r in results:
        want = listed[by_class[r["mutant"]].NAME][1][:1]
        if not r["asserted"] or r["failed"] != want:
            wrong.append(
                f"{r['mutant']}: assert_conformant raised {r['asserted']}, failed {r['failed']}, listed {want}"
            )
        wrong += [f"{r['mutant']}: a failure names no rule or case: {f}" for f in r["failures"]
                  if "\n  breaks " not in f or "\n  case: " not in f]  # fmt: skip
    assert not wrong, "\n".join(wrong)


_ONE_A_GROUP = list({m.RULE.split("/")[0]: m for m in MUTANTS}.values())


@pytest.mark.slow
@pytest.mark.parametrize("mutant", _ONE_A_GROUP, ids=lambda m: m.__name__)
def test_ssu_verify_fails_a_mutant_of_each_group_of_rules(mutant, monkeypatch, capsys):
    """The command line itself, at the profile docs/kit-rules.md lists the checks of, on a mutant
    of each group of rules: exit status 1, the failed checks marked, the broken rule named."""
    import ssu.plugins.registry
    from ssu.cli.main import main

    monkeypatch.setattr(ssu.plugins.registry, "default_registry", lambda *a, **k: demos.registry_with(mutant()))
    checks = rules_table.read_table()[mutant.NAME][1][:1]
    assert main(["verify", "--backend", mutant.NAME, "--profile", "default", *[f"--check={c}" for c in checks]]) == 1
    out = capsys.readouterr().out
    assert all(f"FAIL  {c}" in out for c in checks) and "breaks " in out, out


def test_the_rules_page_lists_every_rule_and_mutant():
    rows = rules_table.read_table()
    assert sorted(rows) == sorted(m.NAME for m in MUTANTS)
    assert {name: rule for name, (rule, _) in rows.items()} == {m.NAME: m.RULE for m in MUTANTS}
    assert set(rule for rule, _ in rows.values()) == set(RULES)
    assert all(checks and set(checks) <= set(ssu.conformance.CHECK_NAMES) for _, checks in rows.values())


# the suite itself ---------------------------------------------------------------------------------
def test_every_rule_is_broken_by_a_mutant():
    used = {m.RULE for m in MUTANTS}
    assert sorted(set(RULES) - used) == [], "rules no mutant breaks"
    assert sorted(used - set(RULES)) == [], "mutants naming an unknown rule"


def test_each_mutant_overrides_one_method_and_says_why():
    names = [m.NAME for m in MUTANTS]
    assert len(names) == len(set(names)) and len(MUTANTS) >= 60
    for mutant in MUTANTS:
        assert issubclass(mutant, Independent) and mutant.__doc__ and mutant.__doc__ != Mutant.__doc__
        assert callable(mutant.SHOWN_BY), mutant
        own = [n for n, v in vars(mutant).items() if inspect.isfunction(v) and not n.startswith("__")]
        assert len(own) == 1, f"{mutant.__name__} overrides {own}"
        base = Deferred if issubclass(mutant, Deferred) else Independent
        assert hasattr(base, own[0]), f"{mutant.__name__}.{own[0]} overrides nothing of {base.__name__}"


@pytest.mark.parametrize(
    "mutant, check, rule",
    [("PackedIgnoresCounts", "packed-calls", "engine/packed-start-column"),
     ("VerifyIgnoresParents", "verify-calls", "engine/verify-parents"),
     ("VerifyGatesWithZeroWithoutZ", "verify-calls", "engine/optional-inputs")],
)  # fmt: skip
def test_an_engine_calls_wrong_outputs_name_the_reading_they_match(mutant, check, rule, registry):
    """Outputs off the oracle name the rule of the misreading that gives them (counts ignored,
    parents ignored, no z taken as zeros), where one does; the group otherwise."""
    name = {m.__name__: m for m in MUTANTS}[mutant].NAME
    (report,) = ssu.conformance.run_conformance(name, checks=[check], registry=registry)
    assert report.status == "fail" and f"breaks {rule}:" in report.failure, report.failure
