"""Hooks of the ``flashinfer-replayssm`` backend. Importing this module imports neither torch nor
flashinfer.

ReplaySSM (FlashInfer ``checkpointing_ssu``) keeps per slot a checkpoint state plus a ring of the
last tokens' inputs and writes the checkpoint only when the ring is full (see :mod:`.layout` for
the buffers, :mod:`.cursors` for the commit rule). The cursors are shared by every layer of a
state group (``Capabilities.layers_share_commit``): between two commits every layer is stepped
once with the same slots. With speculation the engine calls ``commit`` after the last layer; with
speculation off the step of the last layer commits (option ``commit_on_last_layer``, default), or
the engine calls ``commit(state, slots, ones)`` itself when that option is false.
"""

from __future__ import annotations

import ssu

from .options import MAX_WINDOW, ReplayOptions

NAME = "flashinfer-replayssm"
#: checkpointing_ssu's output tiling handles 32 or 64 rows per head (P = 80 does not build)
HEADDIMS = (32, 64)
#: its replay MMA passes cover 32 columns of N each, in pairs
DSTATES = (64, 128, 192, 256)


@ssu.hookimpl
def ssu_backend():
    """Declare the backend: CUDA only, FlashInfer's head shapes, speculative decoding, guarded slot ids."""
    return ssu.BackendSpec(
        name=NAME,
        api_version="1.4",
        factory=_factory,
        capabilities=ssu.Capabilities(
            devices={"cuda"},
            state_dtypes={"fp32", "bf16", "fp16"},
            input_dtypes={"bf16"},
            max_tokens_per_step=MAX_WINDOW,
            speculative=True,
            headdims=HEADDIMS,
            dstates=DSTATES,
            cuda_graphs=True,
            layers_share_commit=True,
            any_pad_slot_id=True,
            guards_slots=True,
            tied_inputs=True,
            contiguous_rows=True,
            dt_bias_as_dt=True,
            # an fp32 state's checkpoint is written at bf16 precision: over a long decode its
            # states differ from the float64 oracle by 1.4e-3 relative (H200), bf16's order
            state_precision="bf16",
        ),
        options_class=ReplayOptions,
        description="FlashInfer ReplaySSM (checkpointing_ssu): checkpoint + ring of recent inputs, cursor commits",
        url="https://github.com/ssu-project/ssu/tree/main/backends/flashinfer_replayssm",
        priority=30,
    )


@ssu.hookimpl
def ssu_probe(device):
    """Available where FlashInfer is installed and the GPU's compute capability is supported."""
    from ssu_backend_flashinfer.availability import flashinfer_availability

    return flashinfer_availability(device)


def problem_reasons(problem, options) -> list[str]:
    """Why FlashInfer's checkpointing_ssu build cannot serve ``problem`` with ``options``."""
    reasons = []
    T = problem.tokens_per_step
    if options.max_window < T:
        reasons.append(
            f"max_window={options.max_window} is below tokens_per_step={T}: the ring must hold a whole "
            f"step; set max_window between {T} and {MAX_WINDOW}"
        )
    return reasons


@ssu.hookimpl
def ssu_supports(problem, options):
    """Accept the problem unless a shape, dtype or option is outside what the ReplaySSM kernel builds."""
    reasons = problem_reasons(problem, options)
    return ssu.Verdict.reject(*reasons) if reasons else ssu.ACCEPT


@ssu.hookimpl
def ssu_allocate_state(ctx, num_layers):
    """Hook: allocate checkpoints and rings sized by the ring-length option."""
    from . import layout

    return layout.allocate(ctx.problem, num_layers, ctx.options.ring_length(ctx.problem.tokens_per_step), ctx.spec.name)


@ssu.hookimpl
def ssu_allocate_scratch(ctx):
    """FlashInfer's two-kernel scratch for ``max_batch`` plus index buffers: before any capture."""
    from .translate import allocate_scratch

    return allocate_scratch(ctx.problem, ctx.options, ctx.faults)


@ssu.hookimpl
def ssu_commit(ctx, state, slots, num_accepted):
    """Hook: advance each row's cursor by its accepted tokens and re-checkpoint rows whose ring is full."""
    from ssu.contract.errors import InputError

    from .translate import commit

    if not ctx.problem.speculative and ctx.options.commit_on_last_layer:
        raise InputError(
            "commit: with speculation off, backend 'flashinfer-replayssm' commits at the step of the "
            "group's last layer (option commit_on_last_layer = true); set commit_on_last_layer = false "
            "in [ssu.backends.flashinfer-replayssm] to commit explicitly"
        )
    commit(ctx.scratch, ctx.scratch["advance"], state, slots, num_accepted)


@ssu.hookimpl
def ssu_traffic(ctx, batch, accepted):
    """Hook: checkpoint and ring bytes of a step; a flush folds the old tokens only (the new ones
    stay in the ring), and a ring token is x and B in bf16 and d in fp32."""
    p = ctx.problem
    token = 2 * (p.nheads * p.headdim + p.ngroups * p.dstate) + 4 * p.nheads
    return ssu.measure.traffic.checkpoint_and_ring(
        p, batch, window=ctx.options.max_window, accepted=accepted, token_bytes=token, folds_new=False
    )


@ssu.hookimpl
def ssu_read_state(ctx, state, slots, layer):
    """Hook: materialise the current states of ``slots`` by replaying their rings over the checkpoints."""
    from . import layout

    return layout.read(state, slots, layer, ctx.problem.tokens_per_step, ctx.options.max_window)


@ssu.hookimpl
def ssu_write_state(ctx, state, slots, values, layer):
    """Hook: store ``values`` as the checkpoints of ``slots`` and empty their rings."""
    from . import layout

    layout.write(state, slots, values, layer, ctx.problem.tokens_per_step, ctx.options.max_window)


@ssu.hookimpl
def ssu_warmup(ctx, state, step):
    """JIT build of the module (with progress lines), then FlashInfer's autotuning on a private
    state, saved to (or loaded from) the tuning cache file. The live state is not touched."""
    from .warmup import build, log, tune

    for index_dtype in ("int32",):
        build(ctx, index_dtype)
    log(tune(ctx))


def _factory(ctx):
    from .translate import make_step

    return make_step(ctx)
