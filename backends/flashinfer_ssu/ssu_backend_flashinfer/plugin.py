"""Hooks of the ``flashinfer`` backend. Importing this module imports neither torch nor flashinfer.

State layout: the versioned slots of :mod:`ssu.state.slot_state` (shared with the reference and triton
backends), allocated or adopted from an engine. Without speculation each slot has one version and
FlashInfer updates it in place (or writes ``dst_slots``). With speculation (T tokens) an allocated
state keeps T + 1 versions per slot, seen by FlashInfer as ``(num_slots + 1) * (T + 1)`` cache
rows: the step reads row ``slot * K + cursor`` and writes token t's state to row
``slot * K + (cursor + 1 + t) % K`` (FlashInfer's ``dst_state_batch_indices``); ``commit`` moves
the cursor only. On an adopted cache the step writes token t's state to the drafts beside it
(FlashInfer's intermediate-state buffer, the cache itself left as it was) and ``commit`` copies the
accepted one in. The rows are guarded and computed (a few tiny torch ops into scratch buffers)
at the first layer of a step and reused by its other layers (:mod:`.translate`), so a CUDA graph
should hold whole decode steps (every layer and the commit), as engines capture them.
"""

from __future__ import annotations

import sys
import time

import ssu
from ssu.state.slot_state import ssu_adopt_state, ssu_allocate_state, ssu_read_state, ssu_write_state  # noqa: F401

from .availability import compute_capability, flashinfer_availability
from .options import FlashInferOptions

NAME = "flashinfer"
MAX_TOKENS = 16
#: what FlashInfer 0.7.4 compiles its SSU for, on sm80, sm90 and sm100 alike: it moves each state row
#: in vectors of N / 32 values and each output row in vectors of P / 32, so P and N start at 32 (a
#: dstate of 16 fails to build); these are the sizes built and checked against the reference on an
#: H200 (backends/flashinfer_ssu/tests/test_flashinfer_gpu.py)
HEADDIMS = (32, 64, 80, 96, 128)
DSTATES = (32, 64, 96, 128, 256)
_logged: set = set()


def log(message: str) -> None:
    """Print one line to stderr, prefixed with the backend's name."""
    print(f"[ssu flashinfer] {message}", file=sys.stderr, flush=True)


@ssu.hookimpl
def ssu_backend():
    """Declare the backend: CUDA only, FlashInfer's head shapes, adopted states and destination slots."""
    return ssu.BackendSpec(
        name=NAME,
        api_version=ssu.PLUGIN_API_VERSION,
        factory=_factory,
        capabilities=ssu.Capabilities(
            devices={"cuda"},
            max_tokens_per_step=MAX_TOKENS,
            speculative=True,
            headdims=HEADDIMS,
            dstates=DSTATES,
            stochastic_rounding=True,
            cuda_graphs=True,
            torch_compile=True,
            adopt_state=True,
            destination_slots=True,
            any_pad_slot_id=True,
            guards_slots=True,
            tied_inputs=True,
            contiguous_rows=True,
            dt_bias_as_dt=True,
            engine_calls={"packed", "verify"},
        ),
        options_class=FlashInferOptions,
        description="FlashInfer selective_state_update (JIT-compiled CUDA), algorithm choice, destination slots",
        url="https://github.com/ssu-project/ssu/tree/main/backends/flashinfer_ssu",
        priority=40,
    )


@ssu.hookimpl
def ssu_probe(device):
    """Available where FlashInfer is installed and the GPU's compute capability is supported."""
    return flashinfer_availability(device)


def algorithm_problems(problem, options, capability) -> list[str]:
    """Why ``options.algorithm`` cannot serve ``problem`` on a GPU of ``capability``."""
    algo = options.algorithm
    reasons = []
    if algo in ("vertical", "horizontal"):
        major, minor = capability
        if problem.tokens_per_step > 1 and major < 10:
            reasons.append(
                f"algorithm {algo!r} with several tokens per step needs SM100 (Blackwell); "
                f'this GPU is SM{major}{minor}: use algorithm = "simple" or "auto"'
            )
        elif major < 9:
            reasons.append(f"algorithm {algo!r} needs SM90 or newer; this GPU is SM{major}{minor}")
        elif algo == "vertical" and (problem.headdim % 16 or problem.headdim < 48):
            reasons.append(f"algorithm 'vertical' needs headdim a multiple of 16 and >= 48, got {problem.headdim}")
        elif algo == "horizontal" and (problem.headdim % 64 or problem.headdim > 256):
            reasons.append(f"algorithm 'horizontal' needs headdim a multiple of 64 and <= 256, got {problem.headdim}")
    return reasons


@ssu.hookimpl
def ssu_supports(problem, options):
    """Accept the problem unless the chosen algorithm or stochastic rounding cannot serve it on this GPU."""
    reasons = []
    if options.stochastic_rounding and problem.state_dtype != "fp16":
        reasons.append(f"stochastic_rounding applies to an fp16 state cache only (state is {problem.state_dtype})")
    if problem.device_type == "cuda":
        reasons += algorithm_problems(problem, options, compute_capability(problem.device))
    reasons += build_problems(problem)
    reasons += engine_call_problems(problem)
    return ssu.Verdict.reject(*reasons) if reasons else ssu.ACCEPT


#: bytes a value of each state dtype
STATE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8_e4m3": 1}


def build_problems(problem) -> list[str]:
    """Why FlashInfer cannot build its SSU module for ``problem``: every module compiles its
    multi-token kernel, which gives each of 8 lanes of a row next_pow2(dstate) / 8 state values
    in tiles of 16 / (bytes a value) values, so a tile needs dstate >= 32 for an fp32 state, 64 for
    a 16-bit one and 128 (rounded up to a power of two) for an 8-bit one; below that the build
    fails on a zero-sized register array (FlashInfer 0.7.4, kernel_selective_state_update_mtp_simple)."""
    width = STATE_BYTES.get(problem.state_dtype)
    if width is None:
        return []
    least = 32 * 4 // width
    padded = 1 << max(problem.dstate - 1, 0).bit_length()
    if padded >= least:
        return []
    return [
        f"a {problem.state_dtype} state with dstate {problem.dstate}: FlashInfer's module does not build for "
        f"it (its multi-token kernel needs dstate >= {least} for a {width}-byte state value); use an fp32 state "
        "or another backend (triton serves it)"
    ]


def engine_call_problems(problem) -> list[str]:
    """Why FlashInfer's own forms cannot serve the engine calls of ``problem``."""
    if not problem.engine_calls:
        return []
    reasons = []
    if problem.speculative:
        reasons.append(
            "the engine call forms on a speculative problem: this backend serves them on one version of each slot "
            "(open the kernel with speculative=False; the forms commit nothing)"
        )
    ratio = problem.heads_per_group
    if ratio & (ratio - 1) or ratio > 64:
        reasons.append(
            f"the engine call forms with {ratio} heads per group: FlashInfer's multi-token kernel takes a power of "
            "two up to 64"
        )
    return reasons


@ssu.hookimpl
def ssu_engine_call(ctx, form):
    """vLLM's packed call and SGLang's verify call through FlashInfer's own forms (:mod:`.engine_forms`)."""
    from .engine_forms import make_packed, make_verify

    return make_packed(ctx) if form == "packed" else make_verify(ctx)


@ssu.hookimpl
def ssu_allocate_scratch(ctx):
    """Index buffers of the speculative path (read rows, destination rows per token), zero
    D vectors for calls without D, and the stochastic-rounding seed: all before any capture."""
    from .scratch import allocate_scratch

    return allocate_scratch(ctx.problem, ctx.options)


@ssu.hookimpl
def ssu_commit(ctx, state, slots, num_accepted):
    """Hook: copy each row's accepted draft state into its slot."""
    from .translate import commit

    commit(ctx, state, slots, num_accepted)


@ssu.hookimpl
def ssu_warmup(ctx, state, step):
    """JIT-compile every FlashInfer module the problem needs (state dtype, input dtype, dt dtype =
    input dtype, tokens, each index dtype of ``warmup_index_dtypes``) by running one step on
    scratch rows, with a line per module: built, or found in FlashInfer's JIT cache."""
    from .modules import warm_module

    if ctx.problem.device_type != "cuda":  # nothing to compile where FlashInfer does not run
        return
    for index_dtype in ctx.options.warmup_index_dtypes:
        t0 = time.perf_counter()
        cached, name = warm_module(ctx, index_dtype)
        took = time.perf_counter() - t0
        where = "found in FlashInfer's JIT cache" if cached else "compiled"
        log(f"module {name}: {where} ({took:.1f} s)")
    if ctx.problem.engine_calls:
        from .modules import warm_engine_calls

        t0 = time.perf_counter()
        names = warm_engine_calls(ctx)
        log(f"engine call modules {', '.join(names)}: ready ({time.perf_counter() - t0:.1f} s)")


def _factory(ctx):
    from .translate import make_step

    key = (ctx.options.algorithm, ctx.problem.device, ctx.problem.tokens_per_step)
    if key not in _logged and ctx.problem.device_type == "cuda":
        _logged.add(key)
        log(f"algorithm: {describe_algorithm(ctx.options.algorithm, ctx.problem)}")
    return make_step(ctx)


def describe_algorithm(algorithm: str, problem) -> str:
    """The effective algorithm, as FlashInfer resolves it on this GPU."""
    if algorithm != "auto":
        return algorithm
    major, minor = compute_capability(problem.device)
    if problem.tokens_per_step > 1:
        return "auto -> simple (several tokens per step" + ("" if major >= 10 else f", SM{major}{minor}") + ")"
    if major < 9:
        return f"auto -> simple (SM{major}{minor})"
    return (
        "auto -> simple while batch x heads < 2 x SMs, else vertical"
        if major < 10
        else "auto -> simple for small batches, else vertical (fp32 state) / horizontal (16-bit state)"
    )
