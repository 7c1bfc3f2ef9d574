"""Shared fixtures: fake distributions on disk, seeded generators."""

from __future__ import annotations

import pytest
import torch

from fakes import FakeSite


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    site = FakeSite(tmp_path / "site", monkeypatch)
    yield site
    site.cleanup()


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)
