"""Repository-wide pytest set-up: without a CUDA device Triton runs in its interpreter (set before
anything imports triton), and tests marked ``gpu`` skip (every distribution's GPU tests use the
marker declared in pyproject.toml)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)
