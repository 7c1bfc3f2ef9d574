"""The conformance suite as pytest tests: one test per check, each over the cases of the chosen
profile (``--ssu-profile``) drawn inside the backend's capabilities. Collected only with
``pytest --ssu-backend NAME``."""

from __future__ import annotations

import pytest

from ssu.testing.checks import CHECK_NAMES, BackendCannotRunHere, CheckSkipped, assert_conformant


@pytest.fixture(scope="module")
def ssu_backend(request):
    """The backend named by --ssu-backend; the suite's tests skip without one."""
    name = request.config.getoption("ssu_backend")
    if not name:
        pytest.skip("run with --ssu-backend NAME")
    return name


@pytest.mark.parametrize("check", CHECK_NAMES)
def test_conformance(ssu_backend, check, request):
    """One conformance check on the backend under test, reported as its own test."""
    try:
        assert_conformant(
            ssu_backend,
            checks=[check],
            profile=request.config.getoption("ssu_profile") or "default",
            max_examples=request.config.getoption("ssu_examples"),
            device=request.config.getoption("ssu_device"),
        )
    except (BackendCannotRunHere, CheckSkipped) as exc:
        pytest.skip(str(exc))
