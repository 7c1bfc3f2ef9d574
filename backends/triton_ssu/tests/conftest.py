"""Triton backend tests: without a CUDA device they run in Triton's interpreter on the CPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(4321)
