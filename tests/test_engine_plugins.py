"""The engine plugins' own logic against stand-ins of the engines' SSU dispatch modules (the real
engines, installed in virtual environments of their own, are driven by tests/engines/): inert
without an ssu configuration, every registry entry routed with one, each call through the drop-in
on the engine's cache, one log line per kernel naming its backend."""

from __future__ import annotations

import logging
import sys
import types
from abc import ABC, abstractmethod

import pytest
import torch

import ssu
from ssu import oracle
from ssu.integrations import sglang as sglang_plugin
from ssu.integrations import vllm as vllm_plugin


def _module(name, **values):
    module = types.ModuleType(name)
    module.__dict__.update(values)
    return module


class _Base(ABC):
    def __init__(self, *args, **kwargs) -> None:
        self.args, self.kwargs = args, kwargs

    @property
    @abstractmethod
    def name(self): ...


class _Own(_Base):
    name = "engine's own"


@pytest.fixture
def vllm_dispatch(monkeypatch):
    """A stand-in for vllm.model_executor.layers.mamba.ops.ssu_dispatch: its registry and base class."""
    dispatch = _module(
        "ssu_dispatch", MambaSSUBackend=_Base, NULL_BLOCK_ID=0, _BACKEND_REGISTRY={"triton": _Own, "cpu": _Own}
    )
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.mamba",
                 "vllm.model_executor.layers.mamba.ops"):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, _module(name))
    monkeypatch.setattr(sys.modules["vllm.model_executor.layers.mamba.ops"], "ssu_dispatch", dispatch, raising=False)
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.mamba.ops.ssu_dispatch", dispatch)
    yield dispatch
    vllm_plugin.unregister()
    ssu.dropin.clear()


def test_without_configuration_the_plugins_do_nothing(vllm_dispatch, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SSU_BACKEND", raising=False)
    vllm_plugin.register()
    sglang_plugin.register()  # returns before importing anything of SGLang's
    assert vllm_dispatch._BACKEND_REGISTRY == {"triton": _Own, "cpu": _Own}
    assert not ssu.dropin.on_open


def test_a_broken_configuration_is_an_error_not_a_silent_fallback(vllm_dispatch, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SSU_BACKEND", raising=False)
    (tmp_path / "ssu.toml").write_text('[ssu]\nbackend = "reference"\nvalidat = true\n')
    with pytest.raises(ssu.ConfigError, match="validat"):
        vllm_plugin.register()


def test_vllm_calls_are_routed_through_ssu(vllm_dispatch, monkeypatch, tmp_path, caplog):
    """Every registry entry becomes the ssu class; its call is the drop-in's on the engine's cache;
    the kernel it opens is announced once."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SSU_BACKEND", "reference")
    vllm_plugin.register()
    registry = vllm_dispatch._BACKEND_REGISTRY
    assert set(registry.values()) == {vllm_plugin.serving()} and registry["triton"]().name == "ssu"
    backend = registry["triton"]("mamba config")
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(8, 4, 8, 16, generator=gen)
    before = cache.clone()
    x, dt, B, C = torch.randn(3, 4, 8), torch.randn(3, 4), torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    A, D, bias = -torch.rand(4) - 1, torch.randn(4), torch.rand(4)
    table = torch.tensor([[5], [0], [2]], dtype=torch.int32)
    out = torch.empty_like(x)
    with caplog.at_level(logging.INFO, logger="vllm.ssu"):
        for _ in range(2):
            cache.copy_(before)
            assert backend(cache, x, dt, A, B, C, D, bias, dt_softplus=True, state_batch_indices=table,
                           dst_state_batch_indices=table, null_block_id=0, out=out) is None  # fmt: skip
    states, y = oracle.ssu_math64(before[[5, 2]], x[[0, 2], None], dt[[0, 2], None], A, B[[0, 2], None],
                                  C[[0, 2], None], D=D, dt_bias=bias, dt_softplus=True)  # fmt: skip
    assert oracle.rel_error(out[[0, 2]], y[:, 0]) < 1e-6 and oracle.rel_error(cache[[5, 2]], states[:, 0]) < 1e-6
    opened = [r.getMessage() for r in caplog.records if "serves vLLM's Mamba2 SSU" in r.getMessage()]
    assert len(opened) == 1 and "backend 'reference'" in opened[0] and "environment SSU_BACKEND" in opened[0]
    vllm_plugin.unregister()
    assert vllm_dispatch._BACKEND_REGISTRY == {"triton": _Own, "cpu": _Own} and not ssu.dropin.on_open
