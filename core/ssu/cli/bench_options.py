"""``ssu bench``'s options, each checked before anything is measured, read or written: a bad value
or an option that does not apply to the run asked for is one line naming the option and what to do
(exit code 2), never a traceback after minutes of timing or a file left half written."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import attrs

from ..contract.dtypes import FLOAT_STATE_DTYPES, INPUT_DTYPES, STATE_DTYPES
from .problem_args import dtype_option, dtype_options
from .usage import UsageError

#: the options of a measuring run, by their argparse names, with their defaults: a saved run
#: (``--from``) is rendered as it was measured, so it refuses each one given
MEASURING = {
    "model": None,
    "nheads": None,
    "headdim": None,
    "dstate": None,
    "ngroups": None,
    "state_dtype": "fp32",
    "input_dtype": "bf16",
    "tokens": 1,
    "call": "step",
    "engine": None,
    "engine_wheel": None,
    "batches": None,
    "backends": "all",
    "config": None,
    "adopt": False,
    "iterations": 40,
    "device": None,
}

#: the form a batch list takes, for the messages
BATCHES_EXAMPLE = "positive whole numbers, comma-separated, e.g. 1,8,32,128"


@attrs.frozen
class Measuring:
    """What a measuring run's options name, each checked and in ssu's own names."""

    states: list
    input_dtype: str
    batches: Optional[list]  # None: the device's default batches
    backends: Optional[list]  # None: every available backend


def option(dest: str) -> str:
    """The option a user types for an argparse destination (``state_dtype`` -> ``--state-dtype``)."""
    return {"saved": "--from"}.get(dest, "--" + dest.replace("_", "-"))


def given(args, defaults: dict) -> list[str]:
    """The options of ``defaults`` that ``args`` sets to something else, as the user typed them."""
    return [option(dest) for dest, default in defaults.items() if getattr(args, dest) != default]


def check_saved(args) -> None:
    """``--from``: only ``--ceiling`` and ``--out`` apply; the ceiling is a positive number of TB/s."""
    extra = given(args, MEASURING)
    if extra:
        raise UsageError(
            f"--from renders a saved run as it was measured: leave out {', '.join(extra)} (they apply to a run "
            "that measures; with --from only --ceiling and --out do)"
        )
    if args.ceiling is not None and not (math.isfinite(args.ceiling) and args.ceiling > 0):
        raise UsageError(f"--ceiling {args.ceiling:g}: give the copy ceiling in TB/s, a positive number such as 3.35")
    if args.out:
        check_out(args.out)


def check_measuring(args) -> Measuring:
    """A measuring run's options, checked in the order they are typed about: what applies, then
    each value; ``--engine`` takes the float state dtypes its kernels hold."""
    if args.ceiling is not None:
        raise UsageError(
            "--ceiling goes with --from (it states a saved run's rows against another copy ceiling); a run that "
            "measures states them against the ceiling it measures"
        )
    if args.engine_wheel and not args.engine:
        raise UsageError("--engine-wheel goes with --engine vllm or --engine sglang")
    if args.engine:
        extra = given(args, {dest: MEASURING[dest] for dest in ("tokens", "call", "adopt")})
        if extra:
            raise UsageError(
                f"--engine times the engine's own calls (decode, and T = 4 speculative): leave out {', '.join(extra)}"
            )
    if args.call != "step" and args.adopt:
        raise UsageError("--adopt: the engine call forms are always timed on an adopted cache; leave --adopt out")
    for dest in ("tokens", "iterations"):
        if getattr(args, dest) < 1:
            raise UsageError(f"{option(dest)} must be at least 1, got {getattr(args, dest)}")
    states = dtype_options(
        args.state_dtype,
        "--state-dtype",
        FLOAT_STATE_DTYPES if args.engine else STATE_DTYPES,
        "a state dtype the engines' kernels take" if args.engine else "a state cache dtype",
    )
    input_dtype = dtype_option(args.input_dtype, "--input-dtype", INPUT_DTYPES, "an input dtype")
    batches = None if args.batches is None else parse_batches(args.batches)
    backends = None if args.backends == "all" else backend_names(args.backends)
    if args.out:
        check_out(args.out)
    return Measuring(states, input_dtype, batches, backends)


def parse_batches(text: str) -> list[int]:
    """``--batches 1,8,32`` -> [1, 8, 32] (distinct, sorted); a usage error naming the first bad entry."""
    values = set()
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        try:
            value = int(item)
        except ValueError:
            value = 0
        if value < 1:
            raise UsageError(f"--batches {text}: {item!r} is not a batch size; give {BATCHES_EXAMPLE}")
        values.add(value)
    if not values:
        raise UsageError(f"--batches {text!r} names no batch size; give {BATCHES_EXAMPLE}")
    return sorted(values)


def backend_names(text: str) -> list[str]:
    """``--backends a,b``: the names, in order, at least one (whether each is installed is
    :func:`check_installed`'s to say, once the registry is at hand)."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise UsageError(f"--backends {text!r} names no backend; give backend names, comma-separated, or all")
    return names


def check_installed(names: list[str], installed: list[str]) -> None:
    """Every name of ``--backends`` is an installed backend (a typo gets the closest name)."""
    from ..plugins.registry import missing_backend_error

    for name in names:
        if name not in installed:
            raise UsageError(f"--backends: {missing_backend_error(name, sorted(installed))}")


def check_out(path: str) -> None:
    """``--out`` names a folder this process can write in, or one it can create (nothing is
    created here: a refused run leaves nothing behind)."""
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        raise UsageError(f"--out {path}: a file, not a folder; give a folder (made if missing)")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"--out {path}: {existing} is a file, so no folder can be made under it; give another folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"--out {path}: cannot write in {existing} (permission denied); give a writable folder")
