"""ReplaySSM backend tests: CPU ones always (the real kernel replaced by :mod:`emulation`); GPU
ones (marker ``gpu``) only with CUDA (ssu-core's pytest plugin skips them otherwise)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton launches of the cache rows run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1618)


@pytest.fixture
def emulated(monkeypatch):
    """A registry holding ``replayssm-emulated`` (the real hooks on the CPU, FlashInfer's kernel
    replaced by the emulation) and the reference backend."""
    import flashinfer.mamba

    import emulation
    from ssu.plugins.registry import Registry

    monkeypatch.setattr(flashinfer.mamba, "checkpointing_ssu", emulation.checkpointing_ssu)
    registry = Registry()
    registry.register(emulation.emulated_plugin())
    return registry
