"""The triton backend on a real GPU: model shapes, CUDA graphs, warmup, the tuning cache across
processes, stochastic rounding. Skipped without CUDA (``-m gpu`` selects these)."""

from __future__ import annotations

import re
import textwrap

import attrs
import pytest
import torch

import ssu
from ssu.conformance import run_on
from ssu.checking.harness import stochastic_rounding_bias
from ssu.checking.inputs import step_inputs
from ssu_backend_triton import compiled_lanes

from triton_helpers import SHAPES, compare_steps, cuda_problem, launch_layer, run_twice, seeded_states

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_model_shapes_match_reference(shape, state_dtype, tokens, gen):
    p = cuda_problem(shape, state_dtype=state_dtype, tokens_per_step=tokens, speculative=tokens > 1)
    compare_steps(p, gen, steps=3, pad=3, layers=2, index_dtype=torch.int64 if tokens > 1 else torch.int32)


@pytest.mark.parametrize("state_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("tokens, adopt", [(1, False), (1, True), (4, False), (4, True)])
def test_8_bit_states_at_the_model_shape(state_dtype, tokens, adopt, gen):
    """Nemotron-H-8B's mixer shape with an 8-bit cache and its row scales, allocated and adopted,
    one token and four (drafts committed), against the reference."""
    p = cuda_problem(
        "nemotron-h-8b",
        state_dtype=state_dtype,
        tokens_per_step=tokens,
        speculative=tokens > 1,
        engine_state=adopt,
        num_slots=136,  # room for distinct destinations of a whole batch beside its sources
    )
    compare_steps(p, gen, steps=3, pad=3, layers=2, adopt=adopt, destinations=adopt and tokens == 1)


@pytest.mark.parametrize("state_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("block_p, warps, tiles", [(8, 1, 8), (16, 1, 4), (32, 2, 2)])
def test_8_bit_states_in_each_looping_tile_shape(state_dtype, block_p, warps, tiles, gen):
    """The looping schedules the tuner may keep for an 8-bit state (tiles of 1024 to 4096 values,
    up to 64 a thread), pinned, against the reference at the model shape."""
    p = cuda_problem("nemotron-h-8b", state_dtype=state_dtype, num_slots=136)
    options = dict(block_p=block_p, num_warps=warps, tiles_per_program=tiles, loop_stages=4)
    compare_steps(p, gen, steps=2, pad=3, layers=1, kernel_options=options)


@pytest.mark.parametrize("headdim, dstate", [(1, 1), (2, 8), (4, 16)])
def test_int8_states_in_tiles_of_few_values_a_thread(headdim, dstate, gen):
    """An int8 cache whose tile gives a thread fewer than the four values the compiled byte
    permute takes (a small P and N) is read by integer arithmetic, not refused by the compiler."""
    import ssu

    p = ssu.Problem(nheads=2, headdim=headdim, dstate=dstate, ngroups=1, state_dtype="int8", input_dtype="fp16",
                    num_slots=8, max_batch=4, device="cuda")  # fmt: skip
    compare_steps(p, gen, steps=2, pad=1, layers=1)


@pytest.mark.parametrize("tokens", [1, 4])
def test_cuda_graph_capture_and_replay(tokens, gen):
    """Step (every layer) and commit captured once, replayed; identical to eager, bit for bit."""
    p = cuda_problem(tokens_per_step=tokens, speculative=tokens > 1, max_batch=48)
    run_on(ssu.open(ssu.Config(backend="triton"), p), "cuda-graph", gen)


def test_warmup_leaves_state_intact(gen, tmp_path):
    p = cuda_problem(max_batch=256, num_slots=300)
    kernel = ssu.open(ssu.Config(backend="triton", backends={"triton": {"tuning_cache": str(tmp_path / "t.json")}}), p)
    (state,) = seeded_states((kernel,), p, gen, layers=2)
    before = {k: v.clone() for k, v in state.buffers.items()}
    kernel.warmup(state)
    assert all(torch.equal(before[k], state.buffers[k]) for k in before)
    assert (tmp_path / "t.json").is_file()


SECOND_PROCESS = textwrap.dedent("""
    import torch, ssu
    p = ssu.Problem(nheads=128, headdim=64, dstate=128, ngroups=8, num_slots=80, max_batch=64, device="cuda")
    k = ssu.open(ssu.Config(backend="triton"), p)
    k.warmup(k.allocate_state())
    print("TABLE", k._ctx.memo["launcher"].table[64])
""")


def test_tuning_cache_reused_by_a_second_process(tmp_path):
    first, second = run_twice(SECOND_PROCESS, tmp_path / "tuning.json")
    assert "tuned Schedule(" in first.stderr
    assert "us (" not in second.stderr and "from " in second.stderr
    assert first.stdout.split("TABLE")[1] == second.stdout.split("TABLE")[1]


def test_stochastic_rounding_is_unbiased(gen):
    """Many sequences with the same state and inputs: the mean of the stochastically rounded fp16
    states approaches the exact fp32 value; round-to-nearest keeps its bias."""
    bias, bias_nearest, spread = stochastic_rounding_bias(
        "triton", gen, nheads=8, headdim=16, dstate=32, ngroups=1, input_dtype="fp32", device="cuda"
    )
    assert spread > 0  # stochastic rounding really varies between sequences
    assert bias < 0.5 * bias_nearest, (bias, bias_nearest)


@pytest.mark.parametrize("state_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("tiles", [1, 8])
def test_state_tiles_move_in_16_byte_vectors(state_dtype, layer, tiles, gen):
    """The compiled step reads and writes the state with 16-byte vector accesses (a 2-byte state
    moved element by element runs at two thirds of the bandwidth): checked in the PTX. A program
    looping over pipelined tiles copies them into shared memory 16 bytes at a time."""
    from ssu.checking.inputs import step_inputs

    p = cuda_problem(state_dtype=state_dtype, max_batch=8, num_slots=16)
    ssm = torch.randn(2, p.num_slots, 1, p.nheads, p.headdim, p.dstate, device="cuda").to(
        getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[state_dtype])
    )
    slots = torch.arange(8, dtype=torch.int32, device="cuda")
    i = step_inputs(p, slots, gen)
    compiled = launch_layer(
        ssm,
        None,
        layer,
        i.x,
        i.dt,
        i.A,
        i.B,
        i.C,
        slots,
        i.D,
        i.z,
        i.dt_bias,
        True,
        torch.empty_like(i.x),
        None,
        pad_slot_id=p.pad_slot_id,
        heads_per_group=p.heads_per_group,
        speculative=False,
        versions=1,
        block_p=8,
        num_warps=1 if tiles == 1 else 2,
        tiles=tiles,
        stages=0 if tiles == 1 else 4,
    )
    ptx = compiled.asm["ptx"]
    assert "st.global.v4" in ptx, "state stores are not vectorised"
    if tiles == 1:
        assert ptx.count("ld.global.v4") >= 2, "state loads are not vectorised"
    else:
        assert re.search(r"cp\.async\.cg\.shared\.global [^;]*\], (16|0x10)\b", ptx), "no 16-byte cp.async state copies"


@pytest.mark.parametrize("tokens", [1, 4])
def test_programmatic_dependent_launch(tokens, gen):
    """Steps and commits launched with programmatic dependent launch (griddepcontrol in the PTX:
    each waits for the kernel before it) match the reference, and replay bit for bit in a CUDA
    graph, where consecutive launches overlap."""
    from ssu.checking.inputs import step_inputs
    from ssu.state import faults
    from ssu.state.slot_kernels import commit

    p = cuda_problem(tokens_per_step=tokens, speculative=tokens > 1, max_batch=48)
    options = {
        "block_p": 8,
        "num_warps": 2,
        "tiles_per_program": 4 if tokens == 1 else 1,
        "loop_stages": 4 if tokens == 1 else 0,
        "programmatic_launch": True,
    }
    compare_steps(p, gen, steps=3, pad=3, layers=2, kernel_options=options)
    run_on(ssu.open(ssu.Config(backend="triton", backends={"triton": options}), p), "cuda-graph", gen)
    ssm = torch.randn(1, 8, 1, p.nheads, p.headdim, p.dstate, device="cuda")
    slots = torch.arange(8, dtype=torch.int32, device="cuda")
    i = step_inputs(attrs.evolve(p, tokens_per_step=1, speculative=False), slots, gen)
    compiled = launch_layer(
        ssm,
        None,
        0,
        i.x,
        i.dt,
        i.A,
        i.B,
        i.C,
        slots,
        i.D,
        i.z,
        i.dt_bias,
        True,
        torch.empty_like(i.x),
        None,
        pad_slot_id=p.pad_slot_id,
        heads_per_group=p.heads_per_group,
        speculative=False,
        versions=1,
        block_p=8,
        num_warps=1,
        pdl=1,
    )
    assert "griddepcontrol.wait" in compiled.asm["ptx"] and "griddepcontrol.launch_dependents" in compiled.asm["ptx"]
    cursor = torch.zeros(8, dtype=torch.int32, device="cuda")
    compiled = commit(
        cursor,
        slots,
        torch.full((8,), 2, dtype=torch.int32, device="cuda"),
        faults.allocate("cuda"),
        pad_slot_id=p.pad_slot_id,
        num_slots=8,
        versions=5,
        pdl=True,
    )
    assert "griddepcontrol.wait" in compiled.asm["ptx"] and torch.equal(cursor, torch.full_like(cursor, 2))


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_branchless_inputs_write_the_same_bits(state_dtype, tokens, gen):
    """Branch-free and branched loads of the optional inputs are two schedules of the same math:
    both match the reference (with and without D, z, dt_bias and softplus), and from the same
    states they write the same state and output bits."""
    from ssu.checking.inputs import step_inputs

    p = cuda_problem(state_dtype=state_dtype, tokens_per_step=tokens, speculative=tokens > 1)
    pins = {
        "block_p": 8,
        "num_warps": 2 if tokens == 1 else 1,
        "tiles_per_program": 4 if tokens == 1 else 1,
        "loop_stages": 4 if tokens == 1 else 0,
    }
    for branchless in (True, False):
        compare_steps(p, gen, steps=2, pad=3, kernel_options={**pins, "branchless_inputs": branchless})
    K = tokens + 1 if tokens > 1 else 1
    pristine = torch.randn(1, 16, K, p.nheads, p.headdim, p.dstate, device="cuda").to(
        getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[state_dtype])
    )
    cursor = torch.randint(0, K, (16,), dtype=torch.int32, device="cuda") if tokens > 1 else None
    slots = torch.tensor([3, 1, p.pad_slot_id, 7, 0, 12], dtype=torch.int32, device="cuda")
    i = step_inputs(p, slots, gen)
    for optional in (True, False):
        results = []
        for branchless in (0, 1):
            ssm, out = pristine.clone(), torch.zeros_like(i.x)
            launch_layer(
                ssm,
                cursor,
                0,
                i.x,
                i.dt,
                i.A,
                i.B,
                i.C,
                slots,
                i.D if optional else None,
                i.z if optional else None,
                i.dt_bias if optional else None,
                optional,
                out,
                None,
                pad_slot_id=p.pad_slot_id,
                heads_per_group=p.heads_per_group,
                speculative=p.speculative,
                versions=K,
                block_p=pins["block_p"],
                num_warps=pins["num_warps"],
                tiles=pins["tiles_per_program"],
                stages=pins["loop_stages"],
                branchless=branchless,
            )
            results.append((ssm, out))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 4])
def test_adopted_caches_and_destinations_at_model_shapes(state_dtype, tokens, gen):
    """An engine's cache (a view into pages twice a slot's size) stepped in place at Nemotron-H-8B
    shapes, drafts committed into it; one-token steps with destination slots and a null block as
    pad id; every other slot and the rest of the pages untouched."""
    p = cuda_problem(
        state_dtype=state_dtype,
        tokens_per_step=tokens,
        speculative=tokens > 1,
        engine_state=True,
        pad_slot_id=0,
        num_slots=160,
    )  # destinations need slots no row reads
    compare_steps(p, gen, steps=3, pad=3, layers=2, adopt=True, destinations=tokens == 1)
    compare_steps(
        cuda_problem(state_dtype=state_dtype, pad_slot_id=199, num_slots=160), gen, steps=2, pad=3, destinations=True
    )


def test_ids_outside_the_cache_on_the_gpu(gen):
    for fields in ({}, {"tokens_per_step": 4, "speculative": True}):
        run_on(ssu.open(ssu.Config(backend="triton"), cuda_problem(**fields)), "guarded-ids", gen)


def test_dropin_in_a_cuda_graph(gen):
    """The drop-in call, once its kernel is open and warm, captured in a CUDA graph: replays write
    the engine's cache and outputs exactly as eager calls do."""
    ssu.dropin.clear()
    H, P, N, G = SHAPES["nemotron-h-8b"]
    b = 16
    config = ssu.Config(backend="triton")
    eager_cache = torch.randn(32, H, P, N, device="cuda")
    graph_cache = eager_cache.clone()
    x = torch.randn(b, H, P, device="cuda").bfloat16()
    dt = torch.randn(b, 1, H, device="cuda").bfloat16().transpose(1, 2).expand(-1, -1, P)
    A = (-torch.rand(H, device="cuda") - 1)[:, None, None].expand(-1, P, N)
    B, C = (torch.randn(b, G, N, device="cuda").bfloat16() for _ in range(2))
    D = torch.randn(H, device="cuda").bfloat16()[:, None].expand(-1, P)
    slots = torch.randperm(32, device="cuda")[:b].int()
    out = torch.empty_like(x)

    def call(cache, target):
        return ssu.selective_state_update(
            cache, x, dt, A, B, C, D, dt_bias=D, dt_softplus=True, state_batch_indices=slots, out=target, config=config
        )

    call(graph_cache, out)  # opens, adopts and warms up (tunes) before the capture
    graph_cache.copy_(eager_cache)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(graph_cache, out)
    graph_cache.copy_(eager_cache)
    eager_out = torch.empty_like(x)
    for _ in range(3):
        graph.replay()
        call(eager_cache, eager_out)
        torch.cuda.synchronize()
        assert torch.equal(out, eager_out) and torch.equal(graph_cache, eager_cache)
    ssu.dropin.clear()


def lanes_config(compiled: bool) -> "ssu.Config":
    """The triton backend with its lanes compiled (then the extension must build here) or in Python."""
    if compiled:
        assert compiled_lanes.module() is not None, compiled_lanes.failure()
    return ssu.Config(backend="triton", backends={"triton": {"compiled_lanes": compiled}})


def lane_kinds() -> set:
    """The types of the drop-in's lanes bound so far."""
    return {type(lane).__name__ for lanes in ssu.dropin.cache._lanes.values() for lane in lanes}


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled lanes", "Python lanes"])
def test_dropin_lanes_write_what_the_step_writes(gen, monkeypatch, compiled):
    """A model's decode calls (no slot ids, no out) through the drop-in's lanes, with batches that
    alternate and an unaligned x the lane declines, write the same bits, outputs and cache, as the
    same calls through the step alone, and agree with the reference; lanes compiled to one C++ call
    and lanes in Python alike."""
    H, P, N, G = SHAPES["nemotron-h-8b"]
    caches = {name: torch.randn(8, H, P, N, device="cuda") for name in ("lanes", "step", "reference")}
    caches["step"].copy_(caches["lanes"])
    caches["reference"].copy_(caches["lanes"])
    A = (-torch.rand(H, device="cuda") - 1)[:, None, None].expand(-1, P, N)
    D = torch.randn(H, device="cuda")[:, None].expand(-1, P)
    dt_bias = (torch.rand(H, device="cuda") - 2)[:, None].expand(-1, P)
    outs: dict = {name: [] for name in caches}
    calls = []
    for b in [1, 1, 1, 3, 3, 1, 3, 1]:
        x = torch.randn(b, H, P, device="cuda")
        dt = torch.randn(b, 1, H, device="cuda").transpose(1, 2).expand(-1, -1, P)
        B, C = (torch.randn(b, G, N, device="cuda") for _ in range(2))
        calls.append((x, dt, B, C))
    unaligned = torch.empty(H * P + 1, device="cuda")[1:].view(1, H, P)
    calls.append((unaligned.copy_(calls[0][0]), *calls[0][1:]))
    for name in caches:
        ssu.dropin.clear()
        monkeypatch.setattr(ssu.dropin.cache, "LANE_BINDS", 0 if name == "step" else 16)
        config = lanes_config(compiled) if name != "reference" else ssu.Config(backend="reference")
        for x, dt, B, C in calls:
            out = ssu.selective_state_update(
                caches[name], x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=True, config=config
            )
            outs[name].append(out)
        if name == "lanes":
            assert sum(len(lanes) for lanes in ssu.dropin.cache._lanes.values()) >= 2  # one per batch at least
            assert ("Lane" in lane_kinds()) is compiled
    torch.cuda.synchronize()
    assert torch.equal(caches["lanes"], caches["step"])
    for got, want, ref in zip(outs["lanes"], outs["step"], outs["reference"]):
        assert torch.equal(got, want)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(caches["lanes"], caches["reference"], rtol=1e-4, atol=1e-4)
    ssu.dropin.clear()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled lanes", "Python lanes"])
def test_dropin_cache_lanes_step_fresh_copies_as_the_step_does(gen, monkeypatch, compiled):
    """Calls that each hand over a fresh copy of the cache, as transformers from 5.25 makes one
    before every decode step: through the cache lanes (one adoption per batch size, not per call)
    the same bits, outputs and final cache, as the same calls through the step alone."""
    H, P, N, G = SHAPES["nemotron-h-8b"]
    start = torch.randn(8, H, P, N, device="cuda")
    A = (-torch.rand(H, device="cuda") - 1)[:, None, None].expand(-1, P, N)
    D = torch.randn(H, device="cuda")[:, None].expand(-1, P)
    dt_bias = (torch.rand(H, device="cuda") - 2)[:, None].expand(-1, P)
    calls = []
    for b in [1, 1, 1, 3, 3, 1, 3]:
        dt = torch.randn(b, 1, H, device="cuda").transpose(1, 2).expand(-1, -1, P)
        calls.append(
            (torch.randn(b, H, P, device="cuda"), dt, *(torch.randn(b, G, N, device="cuda") for _ in range(2)))
        )
    prepare = ssu.dropin.cache._prepare
    results = {}
    for name in ("lanes", "step"):
        ssu.dropin.clear()
        prepared: list = []

        def counted(*args, prepared=prepared, **kwargs):
            prepared.append(1)
            return prepare(*args, **kwargs)

        monkeypatch.setattr(ssu.dropin.cache, "LANE_BINDS", 0 if name == "step" else 16)
        monkeypatch.setattr(ssu.dropin.cache, "_prepare", counted)
        config = lanes_config(compiled)
        cache, outs = start.clone(), []
        for x, dt, B, C in calls:
            cache = cache.clone()
            outs.append(
                ssu.selective_state_update(cache, x, dt, A, B, C, D, dt_bias=dt_bias, dt_softplus=True, config=config)
            )
        results[name] = cache, outs, len(prepared)
        if name == "lanes":
            assert ("Lane" in lane_kinds()) is compiled
    torch.cuda.synchronize()
    assert results["lanes"][2] == 2 and results["step"][2] == len(calls)  # batches 1 and 3; every call
    assert torch.equal(results["lanes"][0], results["step"][0])
    assert all(torch.equal(a, b) for a, b in zip(results["lanes"][1], results["step"][1]))
    ssu.dropin.clear()


def _compiled(jit_fn) -> int:
    """Binaries Triton holds for ``jit_fn`` on every device."""
    return sum(len(entry[0]) for entry in jit_fn.device_caches.values())


@pytest.mark.parametrize("tokens", [1, 4])
def test_warmup_compiles_every_variant_a_step_takes(tokens, gen):
    """After warmup, steps on an engine's adopted cache (one token: into destination slots; four:
    drafts, then the commit), with int32 and int64 slots, launch only binaries warmup compiled,
    so a CUDA graph captured then compiles nothing."""
    from ssu_backend_triton import kernel as triton_kernel

    p = cuda_problem(max_batch=4, num_slots=40, tokens_per_step=tokens, speculative=tokens > 1, engine_state=True)
    kernel = ssu.open(ssu.Config(backend="triton", backends={"triton": {"block_p": 8, "num_warps": 1}}), p)
    kernel.warmup(kernel.allocate_state())
    compiled = _compiled(triton_kernel.ssu_kernel)
    cache = torch.randn(p.num_slots, p.nheads, p.headdim, p.dstate, generator=gen).to(p.device)
    state = kernel.adopt_state(cache)
    for dtype in (torch.int32, torch.int64):
        slots = torch.arange(3, dtype=dtype, device=p.device)
        inputs = step_inputs(p, slots, gen).kwargs()
        if tokens == 1:
            kernel.step(state, **inputs, dst_slots=slots + 8)
        else:
            kernel.step(state, **inputs)
            kernel.commit(state, slots, torch.full((3,), 2, dtype=torch.int32, device=p.device))
    torch.cuda.synchronize()
    assert _compiled(triton_kernel.ssu_kernel) == compiled


def test_direct_launches_follow_alignment_dtype_and_layout(gen, monkeypatch):
    """Steps launched again directly (the kept kernel of ``fast_launch``, the step's kept launch
    arguments of ``step_launches.StepLaunches`` through Triton's launcher) agree with the reference for
    every change Triton specializes on: 16-byte aligned and unaligned inputs, another slot dtype,
    another input layout, each twice (a full launch, then a direct one), one after another and
    back, through the same kernel object."""
    from ssu_backend_triton import fast_launch

    direct_calls = []
    find_direct = fast_launch.direct

    def counting_direct(compiled):
        found = find_direct(compiled)
        if found is None:
            return None
        c_launch, fixed = found

        def counted(*args):
            direct_calls.append(args[0:3])
            return c_launch(*args)

        return counted, fixed

    monkeypatch.setattr(fast_launch, "direct", counting_direct)
    p = cuda_problem(max_batch=8, num_slots=32, input_dtype="fp32")
    kernel = ssu.open(ssu.Config(backend="triton"), p)
    reference = ssu.open(ssu.Config(backend="reference"), p)
    state, ref_state = kernel.allocate_state(), reference.allocate_state()
    slots = torch.randperm(32, device="cuda")[:8].int()
    values = torch.randn(8, p.nheads, p.headdim, p.dstate, device="cuda")
    kernel.write_state(state, slots, values)
    reference.write_state(ref_state, slots, values)
    inputs = step_inputs(p, slots, gen).kwargs()
    padded = torch.empty(8 * p.nheads * p.headdim + 1, device="cuda")
    unaligned = padded[1:].view(8, p.nheads, p.headdim)  # 4 bytes past an aligned address
    variants = [
        {},
        {"x": unaligned.copy_(inputs["x"])},
        {"slots": slots.long()},
        {"x": inputs["x"].transpose(0, 1).contiguous().transpose(0, 1)},
        {"z": None, "D": None},
        {},
    ]
    for change in variants:
        for _ in range(2):
            call = dict(inputs, **change)
            call["x"].mul_(1.01)  # new values every call
            out = kernel.step(state, **call)
            expected = reference.step(ref_state, **call)
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(kernel.read_state(state, slots), reference.read_state(ref_state, slots))
    assert len(fast_launch._kept) >= 1
    assert len(direct_calls) == 6  # each variant's second call but the unaligned one's, and the last's first
