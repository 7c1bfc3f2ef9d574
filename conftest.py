"""Repository-wide pytest hook: tests marked ``gpu`` skip without a CUDA device (every
distribution's GPU tests use the marker declared in pyproject.toml)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)
