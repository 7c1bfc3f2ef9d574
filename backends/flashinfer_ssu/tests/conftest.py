"""FlashInfer backend tests: CPU ones always; GPU ones (marker ``gpu``) only with CUDA (the
repository's conftest.py skips them otherwise)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(2718)
