"""Write docs/kit-rules.md, the table of the kit's rules, from a sweep of the mutants.

    python tests/mutation/sweep.py --json sweep.json
    python tests/mutation/rules_table.py sweep.json          # rewrites docs/kit-rules.md

Each rule of ``ssu.conformance.rules.RULES`` gets its mutants (the bug of each) and the checks that
failed each mutant in the sweep. ``test_mutants.py`` reads the table back: every rule and every
mutant must be in it, and a slow test checks that the kit fails each mutant in the first of the checks
the table names, so the page stays what the kit does.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.path.join(HERE, "..", "..", "docs", "kit-rules.md")

INTRO = """# The rules of the conformance kit

Every rule docs/spec.md sets a backend, under the id a failed check names
(`ssu.conformance.rules`), with the checks of the kit that fail a backend breaking it. The third
column names the backend that proves it: a mutant of `tests/mutation/independent.py` (a backend
written apart from ssu's own implementation, its own PyTorch code for the whole contract and every
capability) that carries that one bug. Each mutant is shown wrong by a call of its own
(`tests/mutation/demos.py`), and the kit at its default profile fails it in the checks listed
(`tests/mutation/sweep.py` runs them all and writes this page); `tests/mutation/test_mutants.py`
holds the demonstrations, the first listed check of each mutant, and this page to the rules.

| rule | what it says | mutant: its bug | checks that fail it |
|---|---|---|---|
"""


COVERAGE = """
## What the kit draws

Every knob of every call form the kit draws, with the values docs/spec.md allows it, for a backend
that declares every capability (the reference backend; a backend declaring less is drawn less:
`contiguous_rows` leaves out the strided inputs, one index dtype leaves out the other). The engine
call forms reach every value of every knob in every case, by construction
(`ssu.conformance.engine_draws.covering`), and every cache dtype meets every buffer dtype over the
cases of a run; the one-token and speculative steps (each argument in each layout) and their
commits reach every value over the cases of the `step` and `decode` checks at the default profile,
the steps with `dst_slots` over those of the `destinations` check. `tests/test_kit_coverage.py`
fails when a cell is never drawn, and this table is written from `ssu.conformance.coverage.markdown`.

"""


def coverage_section() -> str:
    """The section of the page that lists what the kit draws (:func:`ssu.conformance.coverage.markdown`)."""
    from ssu.conformance import coverage
    from ssu.plugins.registry import default_registry

    caps = default_registry().load("reference").spec.capabilities
    return COVERAGE + coverage.markdown(caps)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(results: dict) -> str:
    """The page for ``results`` (mutant class name -> the checks that failed it)."""
    sys.path.insert(0, HERE)
    import mutants
    from ssu.conformance.rules import RULES

    lines = [INTRO.rstrip("\n")]
    for rule, says in RULES.items():
        for i, mutant in enumerate(m for m in mutants.MUTANTS if m.RULE == rule):
            checks = ", ".join(f"`{c}`" for c in results[mutant.__name__])
            first = (f"`{rule}`", _cell(says)) if i == 0 else ("", "")
            lines.append(f"| {first[0]} | {first[1]} | `{mutant.NAME}`: {_cell(mutant.__doc__)} | {checks} |")
    return "\n".join(lines) + "\n" + coverage_section()


def read_table(path: str = PAGE) -> dict:
    """The page read back: mutant name (``mut-...``) -> (its rule, the checks listed)."""
    rows, rule = {}, ""
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            if len(cells) != 4 or not cells[2].startswith("`mut-"):
                continue
            rule = cells[0].strip("`") or rule
            name = cells[2].split("`")[1]
            rows[name] = (rule, [c.strip("` ") for c in cells[3].split(",") if c.strip()])
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as f:
        sweep = json.load(f)
    missed = [r["mutant"] for r in sweep["results"] if not r["caught"]]
    if missed:
        print(f"the kit missed {', '.join(missed)}: no table")
        return 1
    page = table({r["mutant"]: r["failed"] for r in sweep["results"]})
    with open(PAGE, "w") as f:
        f.write(page)
    print(f"wrote {os.path.normpath(PAGE)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
