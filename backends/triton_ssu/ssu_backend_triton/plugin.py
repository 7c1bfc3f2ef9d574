"""Hooks of the ``triton`` backend. Importing this module imports neither torch nor triton."""

from __future__ import annotations

import importlib.util
import sys

import ssu
from ssu.state import slot_state
from ssu.state.slot_state import ssu_adopt_state, ssu_allocate_state, ssu_read_state, ssu_write_state  # noqa: F401

from .interpreter import interpreting
from .options import TritonOptions

NAME = "triton"
MAX_TOKENS = 16
MAX_DSTATE = 512
MAX_HEADDIM = 512


def _log(message: str) -> None:
    print(f"[ssu triton] {message}", file=sys.stderr, flush=True)


@ssu.hookimpl
def ssu_backend():
    """Declare the backend: CUDA (and the CPU under Triton's interpreter), every dtype and option."""
    return ssu.BackendSpec(
        name=NAME,
        api_version=ssu.PLUGIN_API_VERSION,
        factory=_factory,
        capabilities=ssu.Capabilities(
            devices={"cuda", "cpu"},
            state_dtypes={"fp32", "bf16", "fp16", "int8", "fp8_e4m3"},
            max_tokens_per_step=MAX_TOKENS,
            speculative=True,
            stochastic_rounding=True,
            cuda_graphs=True,
            torch_compile=True,
            adopt_state=True,
            destination_slots=True,
            any_pad_slot_id=True,
            guards_slots=True,
            tied_inputs=True,
            engine_calls={"packed", "verify", "tree"},
        ),
        options_class=TritonOptions,
        description="Triton SSU kernel: one state read and T writes per sequence, tuned per batch bucket",
        url="https://github.com/ssu-project/ssu/tree/main/backends/triton_ssu",
        priority=50,
    )


@ssu.hookimpl
def ssu_probe(device):
    """Available with Triton installed on a CUDA GPU, or on the CPU when TRITON_INTERPRET=1 is set."""
    if importlib.util.find_spec("triton") is None:
        return ssu.Availability(False, "the triton package is not installed", "pip install triton")
    kind = str(device).split(":", 1)[0]
    if kind == "cpu":
        if interpreting():
            return ssu.AVAILABLE
        return ssu.Availability(
            False,
            "on the CPU Triton runs only in its interpreter",
            "set TRITON_INTERPRET=1 (slow; meant for tests) or use device='cuda'",
        )
    from ssu.contract.devices import torch_device_availability

    availability = torch_device_availability(device)
    if not availability.available:
        return availability
    if kind == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 0):
            return ssu.Availability(
                False,
                f"compute capability {major}.{minor} is below 8.0 (bf16 loads need Ampere)",
                "use an Ampere or newer GPU, or the reference backend",
            )
    return ssu.AVAILABLE


@ssu.hookimpl
def ssu_supports(problem, options):
    """Accept the problem unless a head shape exceeds what one program holds or an option does not apply."""
    reasons = []
    if options.stochastic_rounding and problem.state_dtype != "fp16":
        reasons.append(f"stochastic_rounding applies to an fp16 state cache only (state is {problem.state_dtype})")
    if problem.dstate > MAX_DSTATE:
        reasons.append(f"dstate={problem.dstate} exceeds {MAX_DSTATE} (one program holds a whole state row)")
    if problem.headdim > MAX_HEADDIM:
        reasons.append(f"headdim={problem.headdim} exceeds {MAX_HEADDIM}")
    return ssu.Verdict.reject(*reasons) if reasons else ssu.ACCEPT


@ssu.hookimpl
def ssu_allocate_scratch(ctx):
    """The Philox seed of stochastic rounding lives on the device, advanced by each step, so that
    a CUDA graph replays with fresh random bits."""
    import torch

    if not ctx.options.stochastic_rounding:
        return {}
    return {"seed": torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64).to(ctx.problem.device)}


@ssu.hookimpl
def ssu_commit(ctx, state, slots, num_accepted):
    """An allocated state: the cursor move of :mod:`ssu.state.slot_state` as one Triton launch (no state
    is copied), with programmatic dependent launch unless the options turn it off. An adopted
    cache: the accepted drafts copied into the engine's tensors, a launch per layer."""
    from ssu.state.slot_kernels import commit, copy_drafts

    p = ctx.problem
    if slot_state.uses_cursor(state):
        commit(
            state.buffers["cursor"],
            slots,
            num_accepted,
            ctx.faults,
            pad_slot_id=p.pad_slot_id,
            num_slots=p.num_slots,
            versions=slot_state.versions(p),
            pdl=ctx.options.programmatic_launch is not False,
        )
        return
    for layer in range(state.num_layers):
        for i, (target, drafts) in enumerate(slot_state.draft_pairs(state, layer)):
            copy_drafts(
                target,
                drafts,
                slots,
                num_accepted,
                ctx.faults,
                pad_slot_id=p.pad_slot_id,
                num_slots=p.num_slots,
                record=layer == 0 and i == 0,
            )


@ssu.hookimpl
def ssu_warmup(ctx, state, step):
    """Compile and tune: per batch bucket, time candidate launch parameters on scratch states
    (never the live ``state``), keep the fastest, save them in the JSON cache. Buckets found in
    the cache are only compiled."""
    warm_up(ctx, _log)


def warm_up(ctx, log) -> None:
    """The warmup of either Triton backend: ``ctx.memo["launcher"]``'s tuning, then every plan of
    its table compiled; on the CPU (the interpreter) nothing to do."""
    from . import tuning

    launcher = ctx.memo["launcher"]
    if ctx.problem.device_type != "cuda":
        log("warmup on the CPU (interpreter): nothing to compile or tune")
        return
    fresh = launcher.tune(log)
    launcher.compile_all()
    path = tuning.cache_path(ctx.options.tuning_cache)
    if fresh and path is not None:
        log(f"saved {len(fresh)} tuned bucket(s) to {path}")


@ssu.hookimpl
def ssu_engine_call(ctx, form):
    """vLLM's packed call and SGLang's verify call, one Triton launch each (:mod:`.engine_launch`)."""
    return engine_calls(ctx, form)


def engine_calls(ctx, form):
    """The callable of ``form`` for a kernel of either Triton backend, launches shared per kernel."""
    from .engine_launch import EngineLaunches

    launches = ctx.memo.get("engine_launches")
    if launches is None:
        launches = ctx.memo["engine_launches"] = EngineLaunches(ctx)
    return launches.packed() if form == "packed" else launches.verify()


def _factory(ctx):
    from .engine import Launcher

    launcher = Launcher(ctx)
    ctx.memo["launcher"] = launcher
    return launcher.make_step()
