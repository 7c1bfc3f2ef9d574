"""Repository-wide pytest set-up: without a CUDA device Triton runs in its interpreter (set before
anything imports triton), for the cross-distribution tests that use it, and torch runs on one
thread. The ``gpu`` marker and its skip come from ssu-core's pytest plugin (``ssu.testing.plugin``)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the tests' tensors are small, and OpenMP's workers spin between small operations: on 2 cores
    # beside another job `python -m pytest` took 4 min 57 s and 5 min 20 s on one thread against
    # 6 min 14 s and 6 min 1 s on torch's default two (2026-12-07)
    torch.set_num_threads(1)

#: the slow set's longest tests, with their seconds in two processes on 2 cores (`.ci/run`'s `--durations` list;
#: only their order matters; a parametrized test without an entry of its own takes its function's).
#: `.ci/run` runs the set in two processes (`pytest -n 2 --maxschedchunk 1`, pytest-xdist), each
#: given a test when it finishes one and holding the test after the one it runs (pytest needs to
#: know the next test): so the longest go first, each followed by a shorter one, and neither process
#: is left with two long ones in a row, or with a long one at the end while the other idles.
LONGEST = {
    "backends/triton_ssu/tests/test_replay_cpu.py": {
        "test_8_bit_checkpoints_pass_the_kit_value_by_value[fold-kernel]": 203,
        "test_matches_reference": 161,
    },
    "backends/triton_ssu/tests/test_triton_cpu.py": {
        "test_passes_each_check_of_the_kit_at_the_smoke_profile[decode]": 212,
        "test_8_bit_states_pass_the_kit_value_by_value[decode]": 325,
        "test_passes_each_check_of_the_kit_at_the_smoke_profile[verify-calls]": 207,
        "test_adopted_caches_destinations_and_pad_ids": 131,
        "test_passes_each_check_of_the_kit_at_the_smoke_profile[packed-calls]": 53,
        "test_passes_each_check_of_the_kit_at_the_smoke_profile[sequences]": 17,
        "test_matches_reference": 116,
    },
    "tests/mutation/test_mutants.py": {
        # in two processes of its own: the longest for the machine
        "test_the_kit_fails_every_mutant_in_the_first_check_the_rules_page_names": 618,
        "test_the_independent_backend_passes_the_kit": 49,
        "test_the_deferred_backend_passes_the_kit": 44,
    },
    "tests/test_conformance_kit.py": {
        "test_reference_is_conformant": 61,
        "test_pytest_plugin_runs_the_suite_on_reference": 59,
    },
    "tests/test_scaffold.py": {"test_generated_backend_installs_and_passes_the_suite": 47},
    "tests/test_wheels.py": {"test_two_backends_install_from_the_wheels_alone_and_are_listed": 40},
    "tests/test_distributions.py": {"test_pytest_inside_one_backend_folder": 25},
}


@pytest.hookimpl(trylast=True)  # after `-m` and `-k` have deselected: these orders are of what runs
def pytest_collection_modifyitems(items):
    """The tests of :data:`LONGEST`, longest first, each followed by one of the others; then the rest
    of the others, all of those in pytest's order."""

    def seconds(item):
        path, _, name = item.nodeid.partition("::")
        tests = LONGEST.get(path, {})
        return tests.get(name, tests.get(name.split("[")[0], 0))

    longest = sorted((item for item in items if seconds(item)), key=seconds, reverse=True)
    others = [item for item in items if not seconds(item)]
    items[:] = (
        [item for pair in zip(longest, others) for item in pair] + longest[len(others) :] + others[len(longest) :]
    )
