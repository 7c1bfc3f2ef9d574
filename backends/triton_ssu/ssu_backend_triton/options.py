"""Options of the ``triton`` backend: ``[ssu.backends.triton]`` in ssu.toml."""

from __future__ import annotations

from typing import Literal, Optional, Union

import attrs

from ssu.contract.errors import ConfigError
from ssu.contract.options import choice, in_range

BLOCK_P_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
NUM_WARPS_CHOICES = (1, 2, 4, 8, 16)


def _register_cap(instance, attribute, value) -> None:
    """0 (no cap) or 32 to 255: below 32 registers a thread the kernel cannot be compiled."""
    if 0 < value < 32:
        raise ConfigError(f"{attribute.name}={value} is too few registers; use 0 (the compiler's choice) or 32 to 255")


@attrs.frozen
class TritonOptions:
    """``block_p`` / ``num_warps`` pin the launch schedule (0: tuned by warmup, else a default per
    shape); with them ``tiles_per_program`` (1: a program per tile of ``block_p`` rows; k: a
    program loops over k tiles; 0: 1, or a whole head when ``loop_stages`` is set) and
    ``loop_stages`` (the pipeline depth of that loop, 0 to 6; below 2 it is not pipelined),
    ``max_registers`` (a cap on registers per thread, 0: the compiler's choice).
    ``programmatic_launch``: programmatic dependent launch, ``"auto"`` (tuned per batch bucket,
    on by default; the commit always uses it), ``true`` or ``false`` for every launch, step and
    commit (ignored below compute capability 9.0).
    ``branchless_inputs``: load D, z, dt_bias and apply softplus without branches (``true``: a
    token's loads issue together, more registers), with uniform branches (``false``), or
    ``"auto"`` (tuned per batch bucket; by default on for an fp32 state with several tokens).
    ``tuning_cache`` is the JSON file of tuned parameters (default
    ``$SSU_TRITON_TUNING_CACHE`` or ``~/.cache/ssu/triton-tuning.json``; ``""`` disables it).
    ``stochastic_rounding`` rounds an fp16 state cache stochastically with ``philox_rounds``
    Philox rounds (off by default; fp16 state only). ``compiled_lanes``: the lanes that launch a
    decode step's later calls of one layout run as one C++ call (built on first use: about 10 to 20
    seconds once per machine and torch version, with a C++ compiler and ninja; a warning says so
    where it cannot be built, and lanes stay in Python); ``false`` keeps them in Python."""

    block_p: int = attrs.field(default=0, validator=choice(0, *BLOCK_P_CHOICES))
    num_warps: int = attrs.field(default=0, validator=choice(0, *NUM_WARPS_CHOICES))
    tiles_per_program: int = attrs.field(default=0, validator=in_range(0, 512))
    loop_stages: int = attrs.field(default=0, validator=in_range(0, 6))
    max_registers: int = attrs.field(default=0, validator=[in_range(0, 255), _register_cap])
    programmatic_launch: Union[bool, Literal["auto"]] = "auto"
    branchless_inputs: Union[bool, Literal["auto"]] = "auto"
    tuning_cache: Optional[str] = None
    stochastic_rounding: bool = False
    philox_rounds: int = attrs.field(default=10, validator=in_range(1, 10))
    tune_iterations: int = attrs.field(default=20, validator=in_range(3, 1000))
    compiled_lanes: bool = True
