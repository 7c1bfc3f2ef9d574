"""Run the conformance kit on every mutant of ``mutants.py`` and report which ones it misses.

    python tests/mutation/sweep.py                      # default profile, 2 processes
    python tests/mutation/sweep.py --jobs 4 --profile quick --only ScalePerHead,DraftsOnKernel
    python tests/mutation/sweep.py --json sweep.json    # also write the results as JSON

Each mutant runs in a worker process (one torch thread each), through
``ssu.testing.assert_conformant``, whose ``ssu.conformance.run_conformance`` reports are what
``ssu verify`` prints: the same checks and cases. A mutant is caught when at least one check
fails; the report names the checks that failed, the first failure, and the mutants no check failed
on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

HERE = os.path.dirname(os.path.abspath(__file__))


def run_one(class_name: str, profile: str, checks) -> dict:
    """The kit's verdict on one mutant (``class_name``, or ``"Independent"`` for the base), through
    ``ssu.testing.assert_conformant`` (``asserted``: whether it raised) and the reports of the
    ``run_conformance`` call it makes, which are what ``ssu verify`` prints."""
    sys.path.insert(0, HERE)
    import torch

    torch.set_num_threads(1)
    import demos
    import mutants
    import ssu.conformance
    from independent import Independent
    from ssu.testing import assert_conformant

    cls = Independent if class_name == "Independent" else getattr(mutants, class_name)
    registry = demos.registry_with(cls())
    started = time.perf_counter()
    reports, original = [], ssu.conformance.run_conformance

    def recording(*args, **kwargs):
        reports.extend(original(*args, **kwargs))
        return reports

    ssu.conformance.run_conformance = recording
    try:
        assert_conformant(cls.NAME, registry=registry, profile=profile, checks=checks)
        asserted = False
    except AssertionError:
        asserted = True
    finally:
        ssu.conformance.run_conformance = original
    failed = [r for r in reports if r.status == "fail"]
    return dict(
        mutant=class_name,
        name=cls.NAME,
        rule=getattr(cls, "RULE", ""),
        caught=bool(failed),
        asserted=asserted,
        failed=[r.check for r in failed],
        failures=[r.failure for r in failed],
        first_failure=failed[0].failure.splitlines()[0] if failed else "",
        seconds=round(time.perf_counter() - started, 1),
    )


def run_all(names, profile: str = "default", jobs: int = 2, checks=None, on_result=None) -> list:
    """:func:`run_one` on each of ``names`` in ``jobs`` processes; ``checks``: None (all), or a
    function of the class name giving the checks to run. Results in the order of ``names``."""
    results = []
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_one, n, profile, checks(n) if callable(checks) else checks) for n in names]
        for future in as_completed(futures):
            results.append(future.result())
            if on_result is not None:
                on_result(results[-1])
    order = {n: i for i, n in enumerate(names)}
    return sorted(results, key=lambda r: order[r["mutant"]])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="default")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated mutant class names")
    parser.add_argument("--checks", default="", help="comma-separated check names (default: all)")
    parser.add_argument("--json", default="", help="write the results to this file")
    parser.add_argument("--base", action="store_true", help="run the independent backend itself")
    args = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    import mutants

    names = [m.__name__ for m in mutants.MUTANTS]
    if args.only:
        names = [n for n in args.only.split(",") if n]
    if args.base:
        names = ["Independent"]
    checks = [c for c in args.checks.split(",") if c] or None
    started = time.perf_counter()

    def show(result):
        mark = "caught " if result["caught"] else "MISSED "
        print(f"{mark} {result['mutant']:<36} {result['seconds']:>6.1f}s  {','.join(result['failed'])}", flush=True)

    results = run_all(names, args.profile, args.jobs, checks, show)
    wall = time.perf_counter() - started
    missed = [r for r in results if not r["caught"]]
    print(f"\n{len(results) - len(missed)} of {len(results)} caught at profile {args.profile!r} in {wall:.0f} s "
          f"({args.jobs} processes)")  # fmt: skip
    for r in missed:
        print(f"  missed: {r['mutant']} ({r['rule']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(profile=args.profile, wall_seconds=round(wall, 1), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
