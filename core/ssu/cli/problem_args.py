"""Problem options shared by ``ssu explain``, ``ssu run`` and ``ssu verify``, checked under the
names the user typed (``--batch``, not ``Problem.max_batch``)."""

from __future__ import annotations

import argparse
from typing import Sequence

from ..contract.dtypes import INPUT_DTYPES, STATE_DTYPES
from ..integrations.shapes import MODEL_SHAPES
from .usage import UsageError

#: head shapes of real models (docs/spec.md); ``--model`` picks one, explicit options override it
MODELS = MODEL_SHAPES

#: the options whose value must be a positive integer when given
POSITIVE = ("nheads", "headdim", "dstate", "ngroups", "batch", "slots", "tokens")

#: the dtype names the options take, for their help (each also in torch's spelling: bfloat16, float8_e4m3fn ...)
STATE_NAMES, INPUT_NAMES = ", ".join(STATE_DTYPES), ", ".join(INPUT_DTYPES)


def add_problem_args(parser: argparse.ArgumentParser, *, batch_default: int = 4) -> None:
    """Add the options that describe a Problem (shapes, dtypes, slots, tokens) to a subcommand's parser."""
    g = parser.add_argument_group("problem (defaults: Nemotron-H-8B head shapes)")
    g.add_argument("--model", choices=sorted(MODELS), default="nemotron-h-8b", help="head shapes of a real model")
    g.add_argument("--nheads", type=int, help="H, heads (per tensor-parallel rank)")
    g.add_argument("--headdim", type=int, help="P, head dimension")
    g.add_argument("--dstate", type=int, help="N, state dimension")
    g.add_argument("--ngroups", type=int, help="G, B/C groups")
    g.add_argument("--state-dtype", default="fp32", help=f"state cache dtype: {STATE_NAMES} (default fp32)")
    g.add_argument("--input-dtype", default="bf16", help=f"input dtype: {INPUT_NAMES} (default bf16)")
    g.add_argument("--batch", type=int, default=batch_default, help=f"sequences per step (default {batch_default})")
    g.add_argument("--slots", type=int, help="cache slots (default: 2 x batch)")
    g.add_argument("--tokens", type=int, default=1, help="tokens per sequence per step; > 1 means speculative")
    g.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 ... (default cpu)")


def dtype_option(value: str, option: str, valid: Sequence[str], kind: str) -> str:
    """The canonical name of an option's dtype (any spelling :func:`ssu.contract.dtypes.dtype_in`
    takes, as ``Problem`` does), else a usage error naming ``option`` and the names it takes."""
    from ..contract.dtypes import dtype_in
    from ..contract.errors import ConfigError

    try:
        return dtype_in(value, valid, what=option, kind=kind)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def dtype_options(value: str, option: str, valid: Sequence[str], kind: str) -> list[str]:
    """An option's comma-separated dtypes, each as :func:`dtype_option` takes it, without repeats."""
    from ..contract.dtypes import dtype_list
    from ..contract.errors import ConfigError

    try:
        return dtype_list(value, valid, what=option, kind=kind)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def check_device(device: str, option: str = "--device") -> str:
    """``device`` if torch can parse it as a device string, else a usage error naming ``option``."""
    import torch

    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"{option} {device!r} is not a device; use cpu, cuda, cuda:1, ...") from None
    return device


def require_device(device: str, option: str = "--device") -> str:
    """``device`` if torch can parse it and reach it here, else a usage error naming ``option`` with
    the reason and its remedy (no CUDA device visible, an index past the last GPU)."""
    from ..contract.devices import torch_device_availability

    check_device(device, option)
    availability = torch_device_availability(device)
    if not availability.available:
        raise UsageError(f"{option} {device}: {availability.message()}")
    return device


def problem_from_args(args: argparse.Namespace):
    """The problem the options describe; every bad value is a usage error naming its option."""
    from ..contract.errors import ConfigError
    from ..contract.problem import Problem

    for name in POSITIVE:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be at least 1, got {value}")
    check_device(args.device)
    state_dtype = dtype_option(args.state_dtype, "--state-dtype", STATE_DTYPES, "a state cache dtype")
    input_dtype = dtype_option(args.input_dtype, "--input-dtype", INPUT_DTYPES, "an input dtype")
    shapes = dict(MODELS[args.model])
    for key in shapes:
        value = getattr(args, key)
        if value is not None:
            shapes[key] = value
    try:
        return Problem(
            **shapes,
            state_dtype=state_dtype,
            input_dtype=input_dtype,
            num_slots=args.slots if args.slots is not None else 2 * args.batch,
            max_batch=args.batch,
            tokens_per_step=args.tokens,
            speculative=args.tokens > 1,
            device=args.device,
        )
    except ConfigError as exc:
        raise UsageError(in_option_words(str(exc))) from None


def in_option_words(message: str) -> str:
    """A :class:`~ssu.Problem`'s error in the options' names (``Problem.state_dtype`` ->
    ``--state-dtype``), as the user typed them."""
    for field, option in (
        ("state_dtype", "--state-dtype"),
        ("input_dtype", "--input-dtype"),
        ("nheads", "--nheads"),
        ("ngroups", "--ngroups"),
    ):
        message = message.replace(f"Problem.{field}", option).replace(f"{field}=", f"{option} ")
    return message
