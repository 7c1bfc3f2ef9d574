"""pytest plugin of the conformance kit (entry point ``pytest11: ssu``).

It adds options, and the ``gpu`` marker that every ssu distribution's GPU tests carry: such a test
is skipped, with the reason, where no CUDA device is visible (``gpu2``: fewer than two) (so that ``pytest`` inside one
backend's folder behaves as it does from the repository); and the ``slow`` marker of tests that take
more than about five seconds on 2 cores. Nothing else is imported or collected
unless ``--ssu-backend`` is given: then the suite module :mod:`ssu.testing.suite` is what runs,
beside the paths the command line names (without any, the suite alone: not the tests of the
folder pytest runs in).
"""

from __future__ import annotations

from pathlib import Path


def pytest_addoption(parser) -> None:
    """Add the conformance suite's options (--ssu-backend, --ssu-profile, --ssu-examples, --ssu-device)."""
    group = parser.getgroup("ssu", "ssu conformance suite")
    group.addoption(
        "--ssu-backend",
        action="store",
        default=None,
        metavar="NAME",
        help="run the ssu conformance suite against installed backend NAME",
    )
    group.addoption(
        "--ssu-profile",
        action="store",
        default=None,
        choices=("smoke", "quick", "default", "thorough"),
        help="how much the conformance suite covers: smoke (tiny shapes, T <= 4, for interpreters), "
        "quick (small shapes), default "
        "(real model shapes too, long decodes; the suite's default), thorough (many more draws)",
    )
    group.addoption(
        "--ssu-examples",
        action="store",
        type=int,
        default=None,
        metavar="N",
        help="problems hypothesis draws per conformance check (default: the profile's)",
    )
    group.addoption(
        "--ssu-device",
        action="store",
        default=None,
        metavar="DEVICE",
        help="device for the conformance suite (default: cuda if the backend supports it and one is present, else cpu)",
    )


def pytest_configure(config) -> None:
    """Register the gpu marker and, with --ssu-backend, the conformance suite's tests."""
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "gpu2: needs two CUDA devices of one host (skipped with fewer)")
    config.addinivalue_line(
        "markers", "slow: more than about five seconds on 2 cores (the repository's `pytest` leaves these to `-m slow`)"
    )
    name = config.getoption("ssu_backend", None)
    if not name:
        return
    import pytest

    from ..contract.errors import SSUError
    from ..plugins.registry import default_registry

    try:
        default_registry().load(name)
    except SSUError as exc:
        raise pytest.UsageError(f"--ssu-backend {name}: {exc}") from None
    suite = str(Path(__file__).with_name("suite.py"))
    if _paths_given(config):
        config.args.append(suite)
    else:  # `pytest --ssu-backend NAME` alone: the suite, not the tests of the folder it runs in
        config.args[:] = [suite]


def _paths_given(config) -> bool:
    """Whether the command line named test paths (else pytest would collect the working folder or
    the configured testpaths)."""
    source = getattr(config, "args_source", None)
    if source is not None:
        return source == config.ArgsSource.ARGS
    return config.args != [str(config.invocation_params.dir)]  # pytest < 7.2


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``gpu`` skip without a CUDA device, ``gpu2`` with fewer than two (torch is
    imported only if there are any)."""
    gpu_items = [item for item in items if "gpu" in item.keywords or "gpu2" in item.keywords]
    if not gpu_items:
        return
    import pytest
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in gpu_items:
        needed = 2 if "gpu2" in item.keywords else 1
        if count < needed:
            reason = "needs a CUDA device" if needed == 1 else f"needs two CUDA devices ({count} visible)"
            item.add_marker(pytest.mark.skip(reason=reason))
