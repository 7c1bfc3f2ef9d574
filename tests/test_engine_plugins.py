"""The engine plugins' own logic against stand-ins of the engines' SSU dispatch modules (the real
engines, installed in virtual environments of their own, are driven by tests/engines/): inert
without an ssu configuration, every registry entry routed with one, each call through the drop-in
on the engine's cache, one log line per kernel naming its backend; a wrong configuration refused
where the plugin loads; the calls ssu does not serve (a Mamba-1 layer's, a problem no configured
backend accepts) passed to the engine's own backend with the same arguments, said once; and
``SSU_CHECK`` comparing each served call with the float64 oracle."""

from __future__ import annotations

import logging
import sys
import types
from abc import ABC, abstractmethod

import pytest
import torch

import ssu
from ssu.checking import oracle
from ssu.integrations import sglang as sglang_plugin
from ssu.integrations import vllm as vllm_plugin

from fakes import beside_backend, bounded_backend, gpu_only_backend


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
    """An engine's own backend: records each call."""

    name = "engine's own"
    calls: list = []

    def __call__(self, *args, **kwargs):
        _Own.calls.append((args, kwargs))


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
    _Own.calls = []
    yield dispatch
    vllm_plugin.unregister()
    ssu.dropin.clear()


@pytest.fixture
def sglang_dispatch(monkeypatch):
    """A stand-in for sglang.kernels.ops.mamba.triton_ops.ssu_dispatch and SGLang's hook registry:
    the dispatch's base class and backend, the registry's hooks by target."""
    dispatch = _module("ssu_dispatch", MambaSSUBackend=_Base, _mamba_ssu_backend=_Own())
    hooks = {}
    registry = types.SimpleNamespace(register=lambda target, hook, kind: hooks.setdefault(target, []).append(hook))
    modules = {
        "sglang.kernels.ops.mamba.triton_ops": _module("triton_ops", ssu_dispatch=dispatch),
        "sglang.kernels.ops.mamba.triton_ops.ssu_dispatch": dispatch,
        "sglang.srt.plugins.hook_registry": _module(
            "hook_registry", HookRegistry=registry, HookType=types.SimpleNamespace(AROUND="around")
        ),
    }
    for name in ("sglang", "sglang.kernels", "sglang.kernels.ops", "sglang.kernels.ops.mamba", "sglang.srt",
                 "sglang.srt.plugins"):  # fmt: skip
        modules.setdefault(name, _module(name))
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    _Own.calls = []
    dispatch.hooks = hooks
    yield dispatch
    sglang_plugin.unregister()
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
    assert all(cls.routes_to_ssu and cls.replaces is _Own for cls in registry.values())
    assert [cls.replaces_name for cls in registry.values()] == ["triton", "cpu"]
    backend = registry["triton"]("mamba config")
    assert backend.name == "ssu"
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


def _mamba1(gen, slots=8, dim=16, N=4, batch=3):
    """A Mamba-1 layer's decode call as vLLM's MambaMixer makes it: state (slots, dim, N), inputs
    (batch, dim), A (dim, N) full rank, D and dt_bias (dim,)."""
    return dict(
        state=torch.randn(slots, dim, N, generator=gen),
        x=torch.randn(batch, dim, generator=gen),
        dt=torch.randn(batch, dim, generator=gen),
        A=-torch.rand(dim, N, generator=gen) - 1,
        B=torch.randn(batch, N, generator=gen),
        C=torch.randn(batch, N, generator=gen),
        D=torch.randn(dim, generator=gen),
        dt_bias=torch.rand(dim, generator=gen),
    )


def _mamba2(gen, batch=3):
    x, dt = torch.randn(batch, 4, 8, generator=gen), torch.randn(batch, 4, generator=gen)
    B, C = torch.randn(batch, 2, 16, generator=gen), torch.randn(batch, 2, 16, generator=gen)
    return dict(x=x, dt=dt, A=-torch.rand(4, generator=gen) - 1, B=B, C=C, D=torch.randn(4, generator=gen),
                dt_bias=torch.rand(4, generator=gen))  # fmt: skip


def _passes(caplog, engine):
    return [r.getMessage() for r in caplog.records if f"ssu passes {engine}'s" in r.getMessage()]


def test_a_mamba1_layers_calls_go_to_vllms_own_backend(vllm_dispatch, monkeypatch, tmp_path, caplog, gen):
    """vLLM's MambaMixer shares the dispatch: its calls reach vLLM's backend the ssu class stands in
    for, with the same arguments, while the Mamba2 calls of the same process stay with ssu; said once."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SSU_BACKEND", "reference")
    vllm_plugin.register()
    backend = vllm_dispatch._BACKEND_REGISTRY["cpu"]("mamba config")
    call = _mamba1(gen)
    state, before = call["state"], call["state"].clone()
    table = torch.tensor([[5], [0], [2]], dtype=torch.int32)
    out = torch.empty_like(call["x"])
    with caplog.at_level(logging.INFO, logger="vllm.ssu"):
        for _ in range(3):
            backend(**call, z=None, dt_softplus=True, state_batch_indices=table, dst_state_batch_indices=table, out=out)
    assert torch.equal(state, before) and len(_Own.calls) == 3
    args, kwargs = _Own.calls[0]
    assert args[0] is state and args[3] is call["A"] and kwargs["state_batch_indices"] is table and kwargs["out"] is out
    assert kwargs["null_block_id"] == 0 and kwargs["dt_softplus"] is True and kwargs["num_accepted_tokens"] is None
    passed = _passes(caplog, "vLLM")
    assert len(passed) == 1 and "to vLLM's own 'cpu' backend" in passed[0] and "Mamba-1" in passed[0], passed
    cache = torch.randn(8, 4, 8, 16, generator=gen)
    backend(cache, **_mamba2(gen), state_batch_indices=table, dst_state_batch_indices=table, out=torch.empty(3, 4, 8))
    assert len(_Own.calls) == 3


def test_a_mamba1_layers_calls_go_to_sglangs_own_backend(sglang_dispatch, monkeypatch, tmp_path, caplog, gen):
    """SGLang's mamba1.py maps its layer onto the Mamba2 signature with one channel a head (P = 1)
    and A (dim, 1, N), which varies along N: not served, passed to SGLang's backend."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SSU_BACKEND", "reference")
    sglang_plugin.register()
    (hook,) = sglang_dispatch.hooks[sglang_plugin.TARGET]
    own = sglang_dispatch._mamba_ssu_backend
    hook(lambda server_args: None, "server args")
    backend = sglang_dispatch._mamba_ssu_backend
    assert backend.name == "ssu" and backend.replaces is own
    m = _mamba1(gen)
    state = m["state"][:, :, None, :].contiguous()
    before = state.clone()
    slots = torch.tensor([5, -1, 2], dtype=torch.int32)
    out = torch.empty(3, 16, 1)
    with caplog.at_level(logging.INFO, logger="sglang.ssu"):
        for _ in range(2):
            backend(state, m["x"][..., None], m["dt"][..., None], m["A"][:, None, :], m["B"][:, None], m["C"][:, None],
                    m["D"][:, None], z=None, dt_bias=torch.zeros(16, 1), dt_softplus=True, state_batch_indices=slots,
                    out=out)  # fmt: skip
    assert torch.equal(state, before) and len(_Own.calls) == 2
    args, kwargs = _Own.calls[0]
    assert args[0] is state and kwargs["state_batch_indices"] is slots and kwargs["pad_slot_id"] == -1
    passed = _passes(caplog, "SGLang")
    assert len(passed) == 1 and "A: varies along" in passed[0] and "to SGLang's own" in passed[0], passed


def test_a_problem_no_configured_backend_serves_goes_to_the_engines_backend(
    vllm_dispatch, monkeypatch, tmp_path, caplog, gen
):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SSU_BACKEND", "gpu-only")
    name = ssu.register_backend(gpu_only_backend())
    try:
        vllm_plugin.register()
        backend = vllm_dispatch._BACKEND_REGISTRY["triton"]("mamba config")
        table = torch.tensor([[1], [2], [3]], dtype=torch.int32)
        caches = [torch.randn(8, 4, 8, 16, generator=gen) for _ in range(2)]
        with caplog.at_level(logging.INFO, logger="vllm.ssu"):
            for cache in caches + caches:
                backend(cache, **_mamba2(gen), state_batch_indices=table, dst_state_batch_indices=table)
    finally:
        ssu.default_registry().unregister(name)
    assert len(_Own.calls) == 4
    passed = _passes(caplog, "vLLM")
    assert len(passed) == 1 and "gpu-only" in passed[0] and "cpu" in passed[0], passed


@pytest.fixture
def bounded(monkeypatch, tmp_path):
    """``SSU_BACKEND=bounded`` (at most 4 sequences of 2 tokens), with the drop-in calls counted."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SSU_BACKEND", "bounded")
    right, calls = ssu.dropin.selective_state_update, []

    def counted(*args, **kwargs):
        calls.append(1)
        return right(*args, **kwargs)

    monkeypatch.setattr(ssu.dropin, "selective_state_update", counted)
    name = ssu.register_backend(bounded_backend(max_batch=4, max_tokens=2))
    yield calls
    ssu.default_registry().unregister(name)


def test_a_problem_passed_to_vllm_leaves_the_other_sizes_with_ssu(vllm_dispatch, bounded, caplog, gen):
    """A batch bucket or T that no backend serves goes to vLLM's backend, and only that problem:
    the same cache's calls of other sizes, served before, stay with ssu; a problem passed on is
    remembered (later calls do not reach the drop-in) and said once, whichever layer meets it."""
    vllm_plugin.register()
    backend = vllm_dispatch._BACKEND_REGISTRY["cpu"]("mamba config")
    caches = [torch.randn(32, 4, 8, 16, generator=gen) for _ in range(2)]

    def where(cache, batch, width=1):
        call = _mamba2(gen, batch=batch * width)
        table = torch.arange(batch * width, dtype=torch.int32).view(batch, width)
        extra = {}
        if width > 1:
            extra = dict(num_accepted_tokens=torch.ones(batch, dtype=torch.int32),
                         cu_seqlens=torch.arange(0, batch * width + 1, width, dtype=torch.int32))  # fmt: skip
        before, engine = cache.clone(), len(_Own.calls)
        backend(cache, **call, dt_softplus=True, state_batch_indices=table, dst_state_batch_indices=table, **extra)
        if len(_Own.calls) > engine:
            assert torch.equal(cache, before)
            return "vLLM"
        assert not torch.equal(cache, before)
        return "ssu"

    with caplog.at_level(logging.INFO, logger="vllm.ssu"):
        for cache in caches:
            sizes = [(3, 1), (7, 1), (3, 1), (6, 1), (2, 1), (12, 1), (4, 1), (2, 2), (2, 3), (2, 2), (2, 3)]
            assert [where(cache, *size) for size in sizes] == [
                "ssu", "vLLM", "ssu", "vLLM", "ssu", "vLLM", "ssu", "ssu", "vLLM", "ssu", "vLLM"
            ]  # fmt: skip
    # per cache: every call of a size ssu serves, and the first of each problem passed on (batch 7,
    # 12, T=3); the second cache's first call of a problem the first passed on asks the drop-in too
    assert len(bounded) == 2 * (6 + 3)
    passed = _passes(caplog, "vLLM")
    assert len(passed) == 3, passed
    assert "decode SSU calls of batch 5 to 8 on a float32 cache" in passed[0] and "bounded" in passed[0], passed
    assert "decode SSU calls of batch 9 to 16 " in passed[1], passed
    assert "speculative (packed) SSU calls of batch 2, T=3 " in passed[2], passed
    assert all("it goes on serving the calls of other sizes" in line for line in passed), passed


def test_a_problem_passed_to_sglang_leaves_the_other_sizes_with_ssu(sglang_dispatch, bounded, caplog, gen):
    sglang_plugin.register()
    (hook,) = sglang_dispatch.hooks[sglang_plugin.TARGET]
    hook(lambda server_args: None, "server args")
    backend = sglang_dispatch._mamba_ssu_backend
    cache = torch.randn(16, 4, 8, 16, generator=gen)

    def where(batch, tokens=0):
        call = _mamba2(gen, batch=batch)
        if tokens:
            call.update({k: torch.stack([call[k]] * tokens, 1) for k in ("x", "dt", "B", "C")})
        before, engine = cache.clone(), len(_Own.calls)
        backend(cache, **call, dt_softplus=True, state_batch_indices=torch.arange(batch, dtype=torch.int32))
        if len(_Own.calls) > engine:
            assert torch.equal(cache, before)
            return "SGLang"
        assert not torch.equal(cache, before)
        return "ssu"

    with caplog.at_level(logging.INFO, logger="sglang.ssu"):
        sizes = [(2,), (6,), (2,), (6,), (2, 2), (2, 3), (2, 2), (2, 3)]
        assert [where(*size) for size in sizes] == ["ssu", "SGLang", "ssu", "SGLang", "ssu", "SGLang", "ssu", "SGLang"]
    assert len(bounded) == 6
    passed = _passes(caplog, "SGLang")
    assert len(passed) == 2 and "decode SSU calls of batch 5 to 8 " in passed[0], passed
    assert "verify SSU calls of batch 2, T=3 " in passed[1], passed


def _bound(received, stand_in) -> dict:
    """The arguments an engine's own backend received, by the names of the engine's signature
    (the stand-in's, which takes the engine's calls)."""
    import inspect

    args, kwargs = received
    signature = inspect.signature(stand_in.__call__)
    bound = signature.bind(None, *args, **kwargs)
    bound.apply_defaults()
    return dict(list(bound.arguments.items())[1:])


def _same(given: dict, received: dict) -> None:
    """Every argument the engine's own backend received is the one its caller gave, by name."""
    assert received.keys() == given.keys()
    wrong = [name for name, value in given.items() if received[name] is not value and received[name] != value]
    assert not wrong, f"passed on changed: {wrong}"


@pytest.mark.parametrize("refused", ["mamba1", "no backend"])
def test_vllms_own_backend_gets_every_argument_as_given(vllm_dispatch, bounded, gen, refused):
    """A call passed on reaches vLLM's backend with each argument the one vLLM passed, in its place
    (B and C not swapped, z and the counts kept), for a Mamba-1 layer's call and for a problem no
    configured backend serves (vLLM's packed form, T=3)."""
    vllm_plugin.register()
    stand_in = vllm_dispatch._BACKEND_REGISTRY["cpu"]
    backend = stand_in("mamba config")
    if refused == "mamba1":
        call = _mamba1(gen)
        state, table, extra = call.pop("state"), torch.tensor([[5], [0], [2]], dtype=torch.int32), {}
        call["z"] = torch.randn(3, 16, generator=gen)
    else:
        state, call = torch.randn(16, 4, 8, 16, generator=gen), _mamba2(gen, batch=6)
        call["z"] = torch.randn(6, 4, 8, generator=gen)
        table = torch.arange(6, dtype=torch.int32).view(2, 3)
        extra = dict(num_accepted_tokens=torch.tensor([2, 3], dtype=torch.int32),
                     cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))  # fmt: skip
    given = dict(state=state, **call, dt_softplus=True, state_batch_indices=table,
                 dst_state_batch_indices=table.clone(), null_block_id=7, out=torch.empty_like(call["x"]),
                 num_accepted_tokens=None, cu_seqlens=None, is_blackwell=True)  # fmt: skip
    given.update(extra)
    backend(**given)
    (received,) = _Own.calls
    _same(given, _bound(received, stand_in))


@pytest.mark.parametrize("refused", ["mamba1", "no backend"])
def test_sglangs_own_backend_gets_every_argument_as_given(sglang_dispatch, bounded, gen, refused):
    """As for vLLM: a Mamba-1 layer's decode call, and a verify call (T=3, EAGLE parents, the
    intermediate-state buffer) that no configured backend serves."""
    sglang_plugin.register()
    (hook,) = sglang_dispatch.hooks[sglang_plugin.TARGET]
    hook(lambda server_args: None, "server args")
    backend = sglang_dispatch._mamba_ssu_backend
    if refused == "mamba1":
        m = _mamba1(gen)
        given = dict(state=m["state"][:, :, None, :].contiguous(), x=m["x"][..., None], dt=m["dt"][..., None],
                     A=m["A"][:, None, :], B=m["B"][:, None], C=m["C"][:, None], D=m["D"][:, None],
                     z=torch.randn(3, 16, 1, generator=gen), dt_bias=m["dt_bias"][:, None],
                     state_batch_indices=torch.tensor([5, -1, 2], dtype=torch.int32), out=torch.empty(3, 16, 1),
                     disable_state_update=False, intermediate_states_buffer=None, cache_steps=None,
                     retrieve_parent_token=None, intermediate_state_indices=None)  # fmt: skip
    else:
        call = _mamba2(gen, batch=2)
        call.update({k: torch.stack([call[k]] * 3, 1) for k in ("x", "dt", "B", "C")})
        given = dict(state=torch.randn(8, 4, 8, 16, generator=gen), **call, z=torch.randn(2, 3, 4, 8, generator=gen),
                     state_batch_indices=torch.tensor([1, 4], dtype=torch.int32), out=torch.empty(2, 3, 4, 8),
                     disable_state_update=True, intermediate_states_buffer=torch.randn(2, 3, 4, 8, 16, generator=gen),
                     cache_steps=3, retrieve_parent_token=torch.tensor([[-1, 0, 0], [-1, 0, 1]]),
                     intermediate_state_indices=torch.tensor([1, 0], dtype=torch.int32))  # fmt: skip
    given.update(dt_softplus=True, pad_slot_id=-1)
    backend(**given)
    (received,) = _Own.calls
    _same(given, _bound(received, type(backend)))


@pytest.fixture
def beside():
    """The in-process ``beside`` backend (first under auto, keeps state beside an adopted cache)."""
    name = ssu.register_backend(beside_backend())
    yield name
    ssu.default_registry().unregister(name)


def test_auto_in_an_engine_passes_over_a_backend_the_drop_in_cannot_use(
    vllm_dispatch, beside, monkeypatch, tmp_path, caplog, gen
):  # fmt: skip
    """``auto`` tries backends by priority: one that keeps state beside the engine's cache comes
    first but is passed over, with why, and the engine's calls are served by one that steps it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SSU_BACKEND", "auto")
    monkeypatch.setenv("SSU_PLUGINS", "beside,reference")
    vllm_plugin.register()
    backend = vllm_dispatch._BACKEND_REGISTRY["cpu"]("mamba config")
    cache = torch.randn(8, 4, 8, 16, generator=gen)
    table = torch.tensor([[1], [2], [3]], dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="vllm.ssu"):
        backend(cache, **_mamba2(gen), state_batch_indices=table, dst_state_batch_indices=table)
    assert not _Own.calls
    (opened,) = [r.getMessage() for r in caplog.records if "serves vLLM's Mamba2 SSU" in r.getMessage()]
    assert "with backend 'reference'" in opened and "requested auto" in opened, opened
    assert "beside: backend 'beside' does not support this problem" in opened, opened
    assert "keeps state beside the engine's cache" in opened, opened


def test_the_drop_in_refuses_a_backend_that_keeps_state_beside_the_cache(beside, bounded, gen):
    """Named alone, such a backend is the drop-in's refusal with why; it is never offered as an
    alternative for a problem the named backend refuses."""
    cache = torch.randn(8, 4, 8, 16, generator=gen)
    with pytest.raises(ssu.BackendUnavailableError, match="backend 'beside' .*keeps state beside the engine's cache"):
        ssu.selective_state_update(cache, **_mamba2(gen), config=ssu.Config(backend="beside"))
    with pytest.raises(ssu.BackendUnavailableError, match="backends that serve this problem here: ") as refused:
        ssu.selective_state_update(cache, **_mamba2(gen, batch=6), config=ssu.Config(backend="bounded"))
    alternatives = str(refused.value).split("backends that serve this problem here: ")[1]
    assert "reference" in alternatives and "beside" not in alternatives, alternatives
    ssu.dropin.clear()


def test_a_typo_in_the_backend_name_stops_vllm_where_it_loads_the_plugin(vllm_dispatch, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SSU_BACKEND", "refrence")
    with pytest.raises(ssu.UnknownBackendError, match=r"^SSU_BACKEND: unknown backend 'refrence'.*'reference'"):
        vllm_plugin.register()
    assert vllm_dispatch._BACKEND_REGISTRY == {"triton": _Own, "cpu": _Own}


@pytest.mark.parametrize(
    "backend, why",
    [("triton-replay", "keeps state beside the engine's cache"), ("flashinfer-replayssm", "does not step an engine")],
)
def test_a_backend_that_cannot_step_an_engines_cache_is_refused_at_startup(
    vllm_dispatch, monkeypatch, tmp_path, backend, why
):  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ssu.toml").write_text(f'[ssu]\nbackend = ["{backend}", "reference"]\n')
    with pytest.raises(ssu.BackendError, match=rf"ssu.toml: backend: backend '{backend}' {why}.*name one of those"):
        vllm_plugin.register()


def test_sglang_stops_where_it_initialises_its_ssu_backend(sglang_dispatch, monkeypatch, tmp_path, caplog):
    """SGLang's plugin loader catches a plugin's error: the plugin logs it and makes SGLang's own
    initialisation raise it, before SGLang serves."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SSU_BACKEND", "nonexistent")
    with caplog.at_level(logging.ERROR, logger="sglang.ssu"):
        sglang_plugin.register()
    assert any("unknown backend 'nonexistent'" in r.getMessage() for r in caplog.records)
    (hook,) = sglang_dispatch.hooks[sglang_plugin.TARGET]
    with pytest.raises(ssu.UnknownBackendError, match="^SSU_BACKEND: unknown backend 'nonexistent'"):
        hook(lambda server_args: None, "server args")
    assert sglang_dispatch._mamba_ssu_backend.name == "engine's own"


def test_ssu_check_compares_every_served_call_with_the_oracle(vllm_dispatch, monkeypatch, tmp_path, caplog, gen):
    """SSU_CHECK=PATH: a JSON line per call, the packed call's accepted counts among it; a call that
    breaks the math is flagged and logged."""
    import json

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SSU_BACKEND", "reference")
    monkeypatch.setenv("SSU_CHECK", str(tmp_path / "checks.jsonl"))
    vllm_plugin.register()
    backend = vllm_dispatch._BACKEND_REGISTRY["cpu"]("mamba config")
    cache = torch.randn(16, 4, 8, 16, generator=gen)
    A = (-torch.rand(4, generator=gen) - 1)[:, None, None].expand(4, 8, 16)
    D, bias = torch.randn(4, generator=gen)[:, None].expand(4, 8), torch.rand(4, generator=gen)[:, None].expand(4, 8)
    call = _mamba2(gen)
    call.update(A=A, D=D, dt_bias=bias, dt=call["dt"][..., None].expand(3, 4, 8))
    table = torch.tensor([[5], [0], [2]], dtype=torch.int32)
    backend(cache, **call, dt_softplus=True, state_batch_indices=table, dst_state_batch_indices=table,
            out=torch.empty(3, 4, 8))  # fmt: skip
    packed = _mamba2(gen, batch=5)
    packed.update(A=A, D=D, dt_bias=bias)
    tables = torch.tensor([[1, 2, 3], [4, 6, 7], [8, 9, 10]], dtype=torch.int32)
    backend(cache, **packed, dt_softplus=True, state_batch_indices=tables, dst_state_batch_indices=tables,
            out=torch.empty(5, 4, 8), num_accepted_tokens=torch.tensor([1, 3, 2], dtype=torch.int32),
            cu_seqlens=torch.tensor([0, 2, 3, 5], dtype=torch.int32))  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "checks.jsonl").read_text().splitlines()]
    assert [(r["form"], r["engine"], r["ok"]) for r in records] == [("step", "vLLM", True), ("packed", "vLLM", True)]
    assert records[1]["accepted"] == [1, 3, 2] and max(records[1]["out"], records[1]["cache"]) < 1e-6

    right = ssu.dropin.selective_state_update

    def wrong(state, *args, **kwargs):  # a backend that forgets D
        args = list(args)
        args[5] = None
        return right(state, *args, **kwargs)

    vllm_plugin.unregister()
    monkeypatch.setattr(ssu.dropin, "selective_state_update", wrong)
    vllm_plugin.register()
    backend = vllm_dispatch._BACKEND_REGISTRY["cpu"]("mamba config")
    with caplog.at_level(logging.WARNING, logger="vllm.ssu"):
        backend(cache, **call, dt_softplus=True, state_batch_indices=table, dst_state_batch_indices=table,
                out=torch.empty(3, 4, 8))  # fmt: skip
    assert not json.loads((tmp_path / "checks.jsonl").read_text().splitlines()[-1])["ok"]
    assert any("outside the error budgets" in r.getMessage() for r in caplog.records)


def _readme_log_lines() -> dict:
    """The log lines README.md quotes ("Using it from an engine"), by engine."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = text.split("tests/test_engine_plugins.py holds these lines equal to what the plugins log -->\n```text\n")[1]
    lines = block.split("\n```")[0].splitlines()
    return {line.split("'s Mamba2 SSU")[0].removeprefix("ssu serves "): line for line in lines}


@pytest.mark.parametrize("engine", ["vLLM", "SGLang"])
def test_the_log_line_readme_quotes_is_the_one_the_plugin_logs(engine, request, monkeypatch, tmp_path, caplog, gen):
    """README's proof that ssu serves an engine is the line the plugin logs, here for the reference
    backend at Nemotron Nano 9B v2's mixer shape (the README's '...' stands for the other fields)."""
    import re

    quoted = _readme_log_lines()[engine]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SSU_BACKEND", "reference")
    H, P, N, G = 128, 80, 128, 8
    cache = torch.zeros(4, H, P, N)
    x, dt, B, C = torch.randn(2, H, P), torch.randn(2, H), torch.randn(2, G, N), torch.randn(2, G, N)
    A, D, bias, out = -torch.rand(H) - 1, torch.randn(H), torch.rand(H), torch.empty(2, H, P)
    logger = "vllm.ssu" if engine == "vLLM" else "sglang.ssu"
    with caplog.at_level(logging.INFO, logger=logger):
        if engine == "vLLM":
            request.getfixturevalue("vllm_dispatch")
            vllm_plugin.register()
            backend = sys.modules["vllm.model_executor.layers.mamba.ops.ssu_dispatch"]._BACKEND_REGISTRY["triton"]("c")
            table = torch.tensor([[1], [3]], dtype=torch.int32)
            backend(cache, x, dt, A, B, C, D, bias, dt_softplus=True, state_batch_indices=table,
                    dst_state_batch_indices=table, null_block_id=0, out=out)  # fmt: skip
        else:
            dispatch = request.getfixturevalue("sglang_dispatch")
            sglang_plugin.register()
            (hook,) = dispatch.hooks[sglang_plugin.TARGET]
            hook(lambda server_args: None, "server args")
            slots = torch.tensor([1, 3], dtype=torch.int32)
            dispatch._mamba_ssu_backend(cache, x, dt, A, B, C, D, z=None, dt_bias=bias, dt_softplus=True,
                                        state_batch_indices=slots, out=out)  # fmt: skip
    logged = [r.getMessage() for r in caplog.records if r.name == logger and r.getMessage().startswith("ssu serves")]
    here = quoted.replace("'triton'", "'reference'").replace("requested triton", "requested reference")
    pattern = re.escape(here).replace(re.escape(" ...:"), " [^:]+:")
    assert len(logged) == 1 and re.fullmatch(pattern, logged[0]), (quoted, logged)
