"""Hooks of the ``triton-replay`` backend: checkpoint + ring of recent inputs, written from
docs/spec.md ("ReplaySSM") as our own Triton kernel (:mod:`.kernel`). It shares the
``triton`` backend's availability rules, tuning cache and launch helpers. Importing this module
imports neither torch nor triton.

A step reads each slot's checkpoint once and writes it only when the slot's ring would exceed the
flush window of the step's batch bucket (tuned by warmup, from every step to ``max_window``), so
most steps move one state read instead of a read and a write. Each layer has its own ring
cursors, so layers are stepped independently, as with every other backend; a speculative commit
moves the cursors of every layer of the state in one launch (no state is copied).
"""

from __future__ import annotations

import ssu

from .. import plugin as triton_plugin
from .options import MAX_WINDOW, ReplayOptions

NAME = "triton-replay"
#: one program holds a (ring rows x N) block of B and a tile of the checkpoint
MAX_DSTATE = 256
MAX_HEADDIM = 256


def _log(message: str) -> None:
    import sys

    print(f"[ssu triton-replay] {message}", file=sys.stderr, flush=True)


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
            max_tokens_per_step=MAX_WINDOW,
            speculative=True,
            stochastic_rounding=True,
            cuda_graphs=True,
            torch_compile=True,
            adopt_state=True,
            destination_slots=True,
            any_pad_slot_id=True,
            guards_slots=True,
            tied_inputs=True,
        ),
        options_class=ReplayOptions,
        description="Triton checkpoint + ring SSU: one state read per step, a write every window, cursor commits",
        url="https://github.com/ssu-project/ssu/tree/main/backends/triton_ssu",
        priority=40,
    )


@ssu.hookimpl
def ssu_probe(device):
    """As the ``triton`` backend: Triton on a CUDA GPU of compute capability 8.0 or newer, or the
    CPU when TRITON_INTERPRET=1 is set."""
    return triton_plugin.ssu_probe(device)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB"


@ssu.hookimpl
def ssu_supports(problem, options):
    """Refuse what one program cannot hold or an option that does not apply; accept with the
    ring's memory cost per slot as a note (``ssu explain`` prints it)."""
    from .layout import ring_bytes_per_slot

    reasons = []
    T = problem.tokens_per_step
    if options.max_window < T:
        reasons.append(
            f"max_window={options.max_window} is below tokens_per_step={T}: the ring must hold a whole step; "
            f"set max_window between {T} and {MAX_WINDOW} in [ssu.backends.triton-replay]"
        )
    if options.window > options.max_window:
        reasons.append(f"window={options.window} exceeds max_window={options.max_window}")
    if options.stochastic_rounding and problem.state_dtype != "fp16":
        reasons.append(f"stochastic_rounding applies to an fp16 state cache only (state is {problem.state_dtype})")
    if problem.dstate > MAX_DSTATE:
        reasons.append(f"dstate={problem.dstate} exceeds {MAX_DSTATE} (a program holds the ring's B rows)")
    if problem.headdim > MAX_HEADDIM:
        reasons.append(f"headdim={problem.headdim} exceeds {MAX_HEADDIM}")
    if reasons:
        return ssu.Verdict.reject(*reasons)
    ring = options.ring_length(T)
    extra = ring_bytes_per_slot(problem, ring)
    state = problem.state_bytes_per_slot()
    return ssu.Verdict.accept(
        f"ring of {ring} tokens: {_mib(extra)} per slot and layer beside a {_mib(state)} state "
        f"(+{100 * extra / state:.1f} %)"
    )


@ssu.hookimpl
def ssu_allocate_state(ctx, num_layers):
    """Hook: zero checkpoints and empty rings."""
    from . import layout

    return layout.allocate(ctx.problem, num_layers, ctx.options.ring_length(ctx.problem.tokens_per_step), NAME)


@ssu.hookimpl
def ssu_adopt_state(ctx, cache, scales):
    """Hook: the engine's tensors are the checkpoints (an 8-bit cache's row scales with them);
    rings and cursors beside them."""
    from . import layout

    ring = ctx.options.ring_length(ctx.problem.tokens_per_step)
    return layout.adopt(ctx.problem, cache, ring, NAME, scales or ())


@ssu.hookimpl
def ssu_sync_state(ctx, state, slots):
    """Hook: fold the rings into the engine's tensors (an adopted state; an allocated one has no
    engine tensor to bring up to date)."""
    from . import layout

    if state.adopted:
        layout.sync(state, slots)


@ssu.hookimpl
def ssu_read_state(ctx, state, slots, layer):
    """Hook: the checkpoint advanced by the slot's ring tokens, in fp32."""
    from . import layout

    return layout.read(state, slots, layer)


@ssu.hookimpl
def ssu_write_state(ctx, state, slots, values, layer):
    """Hook: ``values`` become the checkpoints, the rings of those slots empty."""
    from . import layout

    layout.write(state, slots, values, layer)


@ssu.hookimpl
def ssu_allocate_scratch(ctx):
    """The Philox seed of stochastic rounding, on the device (as the ``triton`` backend's)."""
    return triton_plugin.ssu_allocate_scratch(ctx)


@ssu.hookimpl
def ssu_traffic(ctx, batch, accepted):
    """Hook: the checkpoint and ring bytes of a step at ``batch`` rows, with its bucket's window."""
    from . import layout

    window = ctx.memo["launcher"].table[batch].window
    one_token = not ctx.problem.speculative  # a one-token flush folds the new token too
    return ssu.measure.traffic.checkpoint_and_ring(
        ctx.problem, batch, window=window, accepted=accepted, token_bytes=layout.token_bytes(ctx.problem),
        folds_new=one_token,
    )  # fmt: skip


@ssu.hookimpl
def ssu_commit(ctx, state, slots, num_accepted):
    """Hook: each accepted count joins its slot's ring, in every layer (one launch)."""
    ctx.memo["launcher"].commit(state, slots, num_accepted)


@ssu.hookimpl
def ssu_warmup(ctx, state, step):
    """Compile and tune: per batch bucket, time launch shapes and flush windows on scratch states
    (never the live ``state``), keep the fastest, save them in the JSON tuning cache."""
    triton_plugin.warm_up(ctx, _log)


def _factory(ctx):
    from .engine import ReplayLauncher

    launcher = ReplayLauncher(ctx)
    ctx.memo["launcher"] = launcher
    return launcher.make_step()
