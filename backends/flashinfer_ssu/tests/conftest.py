"""FlashInfer backend tests: CPU ones always (the kernel replaced by :mod:`fi_emulation` where it
has to run); GPU ones (marker ``gpu``) only with CUDA (ssu-core's pytest plugin skips them
otherwise)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton launches of the cache rows run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(2718)


@pytest.fixture
def emulated(monkeypatch):
    """A registry holding ``flashinfer-emulated`` (the real hooks on the CPU, FlashInfer's kernel
    replaced by :mod:`fi_emulation`) and the reference backend."""
    import flashinfer.mamba

    import fi_emulation
    from ssu.plugins.registry import Registry

    monkeypatch.setattr(flashinfer.mamba, "selective_state_update", fi_emulation.selective_state_update)
    registry = Registry()
    registry.register(fi_emulation.emulated_plugin())
    return registry
