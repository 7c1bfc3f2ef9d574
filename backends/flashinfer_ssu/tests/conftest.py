"""FlashInfer backend tests: CPU ones always; GPU ones (marker ``gpu``) only with CUDA."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(2718)
