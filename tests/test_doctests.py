"""The examples in the core's docstrings run as written."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "ssu.plugins.config",
    "ssu.contract.dtypes",
    "ssu.contract.options",
    "ssu.testing.checks",
    "ssu.contract.errors",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
