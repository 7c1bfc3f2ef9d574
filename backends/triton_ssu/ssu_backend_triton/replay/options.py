"""Options of the ``triton-replay`` backend: ``[ssu.backends.triton-replay]`` in ssu.toml."""

from __future__ import annotations

from typing import Literal, Optional

import attrs

from ssu.contract.options import choice, in_range

#: the longest ring window (the ring has max_window + T rows, at most 32)
MAX_WINDOW = 16
BLOCK_P_CHOICES = (1, 2, 4, 8, 16, 32, 64)
NUM_WARPS_CHOICES = (1, 2, 4, 8)


@attrs.frozen
class ReplayOptions:
    """``max_window``: tokens a slot's ring holds before its checkpoint is written (tokens_per_step
    to 16); the ring costs ``max_window + T`` rows of x, B, d and A d per slot and layer (``ssu
    explain`` prints the bytes). ``window``: the flush policy, the ring tokens a step may leave
    unfolded, -1 to choose per batch bucket by warmup (else a default: 0 below batch 16, where bytes
    are not the limit, ``max_window`` above), or 0 (write the checkpoint every step) to
    ``max_window`` for every batch. ``block_p`` / ``num_warps`` / ``tiles_per_program`` /
    ``loop_stages`` pin the launch shape (0: tuned, or a default per shape): tiles of ``block_p``
    rows of a head, programs of ``num_warps`` warps, each over ``tiles_per_program`` tiles whose
    loads are pipelined ``loop_stages`` deep (below 2: not pipelined). ``fold_heads``: the rows
    that flush are served by a kernel of their own launched before the step kernel (which serves
    the other rows beside it), with this many heads per program (-1: tuned with the launch shape,
    off without tuning; 0: never, they fold inside the step kernel). ``stepwise``: how a speculative
    step of window 0 (without the fold kernel) computes its tokens' outputs: 1 by applying the
    tokens to each tile one by one (no gram kernel launched before it), 0 from the gram kernel's B .
    C products, -1 timed both ways by warmup (0 without tuning). ``programmatic_launch``: the step
    and commit take part in programmatic dependent launch (compute capability 9.0 and newer).
    ``tuning_cache``, ``tune_iterations``: as for the ``triton`` backend (the same JSON file, keys
    of their own). ``stochastic_rounding`` rounds an fp16 checkpoint stochastically with
    ``philox_rounds`` Philox rounds. ``write_through_kernel``: what serves a one-token problem
    whose every batch bucket has window 0 (by the ``window`` option, or as warmup tuned it), on a
    state whose rings have never held a token: ``"triton"``, the ``triton`` backend's kernel with
    its own tuned schedules (the same launches, the same tuning-cache entries), or ``"replay"``,
    this backend's write-every-step kernel."""

    max_window: int = attrs.field(default=15, validator=in_range(1, MAX_WINDOW))
    window: int = attrs.field(default=-1, validator=in_range(-1, MAX_WINDOW))
    block_p: int = attrs.field(default=0, validator=choice(0, *BLOCK_P_CHOICES))
    num_warps: int = attrs.field(default=0, validator=choice(0, *NUM_WARPS_CHOICES))
    tiles_per_program: int = attrs.field(default=0, validator=in_range(0, 512))
    loop_stages: int = attrs.field(default=0, validator=in_range(0, 6))
    fold_heads: int = attrs.field(default=-1, validator=in_range(-1, 256))
    stepwise: int = attrs.field(default=-1, validator=in_range(-1, 1))
    programmatic_launch: bool = True
    tuning_cache: Optional[str] = None
    tune_iterations: int = attrs.field(default=20, validator=in_range(3, 1000))
    stochastic_rounding: bool = False
    philox_rounds: int = attrs.field(default=10, validator=in_range(1, 10))
    write_through_kernel: Literal["triton", "replay"] = attrs.field(
        default="triton", validator=choice("triton", "replay")
    )

    def ring_length(self, tokens_per_step: int) -> int:
        """L: ring rows per slot and layer, ``max_window + T``."""
        return self.max_window + tokens_per_step
