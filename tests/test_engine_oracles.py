"""The engines' calls through ssu against the engines' own kernels: vLLM 0.34.0's and SGLang
0.5.23's Triton SSU, run as shipped in Triton's interpreter (:mod:`engine_kernels`), fed the same
cache and inputs as the drop-in ``ssu.selective_state_update`` on the reference and triton
backends. Decode with pad rows on a strided cache, then three speculative rounds of varying
acceptance, as each engine's mixer makes them. Skipped, with how to get them, where the wheels are
not downloaded."""

from __future__ import annotations

import os

import pytest
import torch

import ssu
from ssu.checking import oracle

import engine_kernels

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

H, P, N, G = 4, 8, 16, 2
BACKENDS = ["reference", "triton"]


def _engine(spec):
    archive = engine_kernels.wheel(*spec)
    if archive is None:
        pytest.skip(engine_kernels.missing(*spec))
    try:
        return engine_kernels.vllm_ssu(archive) if spec == engine_kernels.VLLM else engine_kernels.sglang_ssu(archive)
    except Exception as exc:  # the engine's module could not load here: say so, do not fail the suite
        pytest.skip(f"{spec[0]} {spec[1]}'s kernel module does not load here: {type(exc).__name__}: {exc}")


@pytest.fixture(autouse=True)
def fresh_dropin():
    ssu.dropin.clear()
    yield
    ssu.dropin.clear()


def weights(gen):
    """A Mamba2 layer's per-head parameters as its mixer passes them: expanded with stride 0."""
    A = (-torch.rand(H, generator=gen) * 4 - 1)[:, None, None].expand(H, P, N)
    D = torch.randn(H, generator=gen)[:, None].expand(H, P)
    dt_bias = (torch.rand(H, generator=gen) - 2).bfloat16()[:, None].expand(H, P)
    return A, D, dt_bias


def inputs(gen, *lead):
    dt = (torch.rand(*lead, H, generator=gen) * 3 - 2).bfloat16()[..., None].expand(*lead, H, P)
    return dict(
        x=torch.randn(*lead, H, P, generator=gen).bfloat16(),
        dt=dt,
        B=(torch.randn(*lead, G, N, generator=gen) * 0.5).bfloat16(),
        C=(torch.randn(*lead, G, N, generator=gen) * 0.5).bfloat16(),
    )


def strided_cache(gen, slots):
    """A paged cache as an engine holds it: each slot's block one of two in its page."""
    pages = torch.randn(slots, 2, H, P, N, generator=gen)
    return pages[:, 0], pages


def close(what, got, want, tol):
    err = oracle.rel_error(got, want)
    assert err <= tol, f"{what}: relative error {err:.2e} above {tol:.1e}"


OUT_TOL = oracle.output_tolerance("bf16", 4)
STATE_TOL = 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_decode_with_null_blocks_on_a_strided_cache(backend, gen):
    """vLLM's decode call without speculation: (b, 1) tables, rows padded with the null block 0."""
    vllm = _engine(engine_kernels.VLLM)
    cache, pages = strided_cache(gen, 12)
    theirs = cache.clone()
    A, D, dt_bias = weights(gen)
    table = torch.tensor([[5], [0], [9], [2], [0]], dtype=torch.int32)
    call = inputs(gen, 5)
    out, their_out = torch.empty_like(call["x"]), torch.empty_like(call["x"])
    vllm(theirs, **call, A=A, D=D, dt_bias=dt_bias, dt_softplus=True, state_batch_indices=table,
         dst_state_batch_indices=table, null_block_id=0, out=their_out)  # fmt: skip
    ssu.selective_state_update(
        cache, call["x"], call["dt"], A, call["B"], call["C"], D, None, dt_bias, True, state_batch_indices=table,
        dst_state_batch_indices=table, null_block_id=0, out=out, config=ssu.Config(backend=backend),
    )  # fmt: skip
    close("outputs", out, their_out, OUT_TOL)
    close("cache", cache[1:], theirs[1:], STATE_TOL)  # block 0 is the null block: its contents mean nothing


@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_speculative_rounds_match_vllms_kernel(backend, gen):
    """Three rounds of vLLM's packed call with 3 draft tokens: mixed lengths (0 to 4), a padded
    request, counts of the previous round picking each request's start block, int64 tables."""
    vllm = _engine(engine_kernels.VLLM)
    cache, _ = strided_cache(gen, 24)
    theirs = cache.clone()
    A, D, dt_bias = weights(gen)
    table = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [0, 0, 0, 0], [9, 10, 11, 12], [13, 14, 15, 16]])
    config = ssu.Config(backend=backend, validate="full")
    for lengths, accepted in (([4, 4, 4, 2, 1], [1, 1, 1, 1, 1]), ([4, 3, 4, 4, 0], [3, 4, 1, 2, 1]),
                              ([1, 4, 4, 4, 4], [2, 1, 1, 1, 1])):  # fmt: skip
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        counts = torch.tensor(accepted, dtype=torch.int32)
        call = inputs(gen, int(cu[-1]))
        out, their_out = torch.zeros_like(call["x"]), torch.zeros_like(call["x"])
        vllm(theirs, **call, A=A, D=D, dt_bias=dt_bias, dt_softplus=True, state_batch_indices=table,
             dst_state_batch_indices=table, null_block_id=0, out=their_out, num_accepted_tokens=counts,
             cu_seqlens=cu)  # fmt: skip
        ssu.selective_state_update(
            cache, call["x"], call["dt"], A, call["B"], call["C"], D, None, dt_bias, True, state_batch_indices=table,
            dst_state_batch_indices=table, null_block_id=0, out=out, num_accepted_tokens=counts, cu_seqlens=cu,
            config=config,
        )  # fmt: skip
        close("outputs", out, their_out, OUT_TOL)
        close("cache", cache[1:], theirs[1:], STATE_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_decode_with_pad_rows(backend, gen):
    sglang = _engine(engine_kernels.SGLANG)
    cache, _ = strided_cache(gen, 10)
    theirs = cache.clone()
    A, D, dt_bias = weights(gen)
    slots = torch.tensor([3, -1, 7, 1], dtype=torch.int32)
    call = inputs(gen, 4)
    out, their_out = torch.empty_like(call["x"]), torch.empty_like(call["x"])
    sglang(theirs, **call, A=A, D=D, dt_bias=dt_bias, dt_softplus=True, state_batch_indices=slots, out=their_out)
    ssu.selective_state_update(
        cache, call["x"], call["dt"], A, call["B"], call["C"], D, None, dt_bias, True, state_batch_indices=slots,
        out=out, config=ssu.Config(backend=backend),
    )  # fmt: skip
    close("outputs", out, their_out, OUT_TOL)
    close("cache", cache, theirs, STATE_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tree", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_sglang_verify_rounds_match_sglangs_kernel(backend, tree, gen):
    """Three rounds of SGLang's verify call (4 tokens, the cache untouched, every token's state in
    the buffer, an EAGLE tree of parents), each followed by what SGLang does with the accepted
    tokens: the accepted state copied from the buffer into the cache."""
    sglang = _engine(engine_kernels.SGLANG)
    cache, _ = strided_cache(gen, 10)
    theirs = cache.clone()
    A, D, dt_bias = weights(gen)
    slots = torch.tensor([3, 7, -1, 1], dtype=torch.int32)
    rows = torch.arange(4, dtype=torch.int32)
    buffer, their_buffer = torch.zeros(4, 4, H, P, N), torch.zeros(4, 4, H, P, N)
    config = ssu.Config(backend=backend, validate="full")
    for accepted in ([2, 4, 1, 1], [1, 3, 1, 2], [4, 1, 1, 3]):
        parents = None
        if tree:
            parents = torch.full((4, 4), -1, dtype=torch.int64)
            for t in range(1, 4):
                parents[:, t] = torch.randint(0, t, (4,), generator=gen)
        call = inputs(gen, 4, 4)
        out, their_out = torch.zeros_like(call["x"]), torch.zeros_like(call["x"])
        before = cache.clone()
        sglang(theirs, **call, A=A, D=D, dt_bias=dt_bias, dt_softplus=True, state_batch_indices=slots, out=their_out,
               disable_state_update=True, intermediate_states_buffer=their_buffer, cache_steps=4,
               retrieve_parent_token=parents, intermediate_state_indices=rows)  # fmt: skip
        ssu.selective_state_update(
            cache, call["x"], call["dt"], A, call["B"], call["C"], D, None, dt_bias, True, state_batch_indices=slots,
            out=out, disable_state_update=True, intermediate_states_buffer=buffer, cache_steps=4,
            retrieve_parent_token=parents, intermediate_state_indices=rows, config=config,
        )  # fmt: skip
        real = slots >= 0
        close("outputs", out[real], their_out[real], OUT_TOL)
        close("buffer", buffer[real], their_buffer[real], STATE_TOL)
        assert torch.equal(cache, before)
        for b, kept in enumerate(accepted):  # SGLang's own step after verification
            if slots[b] >= 0:
                cache[slots[b]] = buffer[b, kept - 1]
                theirs[slots[b]] = their_buffer[b, kept - 1]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_multi_token_call_writing_the_last_state(backend, gen):
    """SGLang's function with T tokens and no buffer writes the state after the last one."""
    sglang = _engine(engine_kernels.SGLANG)
    cache, _ = strided_cache(gen, 10)
    theirs = cache.clone()
    A, D, dt_bias = weights(gen)
    slots = torch.tensor([4, 0, -1], dtype=torch.int64)
    call = inputs(gen, 3, 3)
    out, their_out = torch.empty_like(call["x"]), torch.empty_like(call["x"])
    sglang(theirs, **call, A=A, D=D, dt_bias=dt_bias, dt_softplus=True, state_batch_indices=slots, out=their_out)
    ssu.selective_state_update(
        cache, call["x"], call["dt"], A, call["B"], call["C"], D, None, dt_bias, True, state_batch_indices=slots,
        out=out, config=ssu.Config(backend=backend),
    )  # fmt: skip
    close("outputs", out[:2], their_out[:2], OUT_TOL)
    close("cache", cache, theirs, STATE_TOL)
