"""FlashInfer backend tests: CPU ones always; GPU ones (marker ``gpu``) only with CUDA (the
repository's conftest.py skips them otherwise)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(2718)


@pytest.fixture
def emulated(monkeypatch):
    """A registry holding ``flashinfer-emulated`` (the real hooks on the CPU, FlashInfer's kernel
    replaced by :mod:`fi_emulation`) and the reference backend."""
    import flashinfer.mamba

    import fi_emulation
    from ssu.registry import Registry

    monkeypatch.setattr(flashinfer.mamba, "selective_state_update", fi_emulation.selective_state_update)
    registry = Registry()
    registry.register(fi_emulation.emulated_plugin())
    return registry
