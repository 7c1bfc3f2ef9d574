"""``ssu compare``: a transformers Mamba2-family model generating with its own decode SSU and
through ssu, side by side: token agreement, the largest logit difference, time per token."""

from __future__ import annotations

import statistics
from typing import Sequence

from .problem_args import dtype_option, require_device
from ..contract.dtypes import QUANTIZED_STATE_DTYPES
from ..contract.errors import counted
from .usage import UsageError

EXIT_OK, EXIT_WRONG = 0, 1
#: what the SSU's time and share columns say where the difference from the zeros is within the noise
NOISE = "below noise"
#: the dtypes ``--dtype`` loads a model in
MODEL_DTYPES = ("fp32", "bf16")


def add_compare_parser(sub) -> None:
    """Register ``ssu compare`` and its options on the CLI's subcommand table."""
    from ..integrations.hf_models import ARCHITECTURES, PRESETS

    p = sub.add_parser("compare", help="a transformers model decoding with its own SSU and through ssu, side by side")
    p.add_argument(
        "--arch", help=f"architecture with random weights at --preset's mixer shapes: {', '.join(ARCHITECTURES)}"
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="tiny",
        help="mixer shapes of a real model (default tiny: H=8 P=8 N=16 G=2, for a CPU)",
    )
    p.add_argument("--layers", type=int, default=4, help="Mamba2 layers of the random model (default 4)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary of the random model (default 1024)")
    p.add_argument("--checkpoint", help="a local checkpoint folder instead of random weights (nothing is downloaded)")
    p.add_argument("--hub", help="a model name on the Hugging Face hub (downloaded if not cached)")
    p.add_argument("--batch", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per sequence (default 8)")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens generated per sequence (default 16)")
    p.add_argument("--dtype", default="fp32", help="model dtype: fp32 or bf16 (default fp32)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, ... (default cpu)")
    p.add_argument("--config", help="ssu.toml or pyproject.toml (default: search the working directory)")
    p.add_argument("--backend", help="backend name, comma-separated fallback list, or auto")
    p.add_argument("--no-share", action="store_true", help="skip the run that measures the SSU's share of a token")
    p.add_argument(
        "--state-dtype",
        help="int8 or fp8_e4m3: through ssu, round the model's cache after each step to what an 8-bit cache of "
        "this dtype holds "
        "(its accuracy; the time per token then includes the rounding)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompts (default 0)")


def _model(args):
    import torch

    from ..integrations import hf_models

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    given = [name for name in ("arch", "checkpoint", "hub") if getattr(args, name)]
    if len(given) != 1:
        raise UsageError("give one of --arch (random weights), --checkpoint (a local folder) or --hub (a hub name)")
    if args.arch:
        return (
            hf_models.random_model(
                args.arch, args.preset, args.layers, vocab=args.vocab, dtype=dtype, device=args.device, seed=args.seed
            ),
            f"{args.arch} (random weights, preset "
            f"{args.preset}: H={hf_models.PRESETS[args.preset][0]} P={hf_models.PRESETS[args.preset][1]} "
            f"N={hf_models.PRESETS[args.preset][2]} G={hf_models.PRESETS[args.preset][3]}, "
            f"{counted(args.layers, 'layer')})",
        )
    where = args.checkpoint or args.hub
    return hf_models.pretrained_model(where, hub=bool(args.hub), dtype=dtype, device=args.device), where


def cmd_compare(args) -> int:
    """Decode one transformers model with its own SSU and through ssu; print both and how far they agree."""
    import importlib.util

    args.dtype = dtype_option(args.dtype, "--dtype", MODEL_DTYPES, "a dtype ssu compare loads models in")
    if args.state_dtype is not None:
        args.state_dtype = dtype_option(
            args.state_dtype, "--state-dtype", QUANTIZED_STATE_DTYPES, "an 8-bit state dtype"
        )
    if importlib.util.find_spec("transformers") is None:
        raise UsageError("ssu compare needs transformers: pip install 'ssu-core[transformers]'")
    import torch

    from ..plugins.config import load_config
    from ..integrations import hf_models
    from ..integrations.transformers import find_mixers

    for name in ("layers", "vocab", "batch", "prompt_len", "new_tokens"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.new_tokens < 2:
        raise UsageError("--new-tokens must be at least 2 (the first token comes from the prefill)")
    if args.checkpoint and hf_models.not_a_checkpoint(args.checkpoint):
        raise UsageError(
            f"--checkpoint {args.checkpoint}: {hf_models.not_a_checkpoint(args.checkpoint)}; give a local "
            "checkpoint folder (config.json and weights), or --hub NAME for a model on the Hugging Face hub"
        )
    require_device(args.device)
    config = load_config(args.config, backend=args.backend)
    model, what = _model(args)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=gen).to(args.device)
    print(
        f"ssu compare: {what}, {args.dtype}, batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new "
        f"tokens, {args.device}",
        flush=True,
    )
    if args.state_dtype:
        print(
            f"through ssu the cache is rounded after each step to an {args.state_dtype} cache's contents (row scales "
            "recomputed at every write; docs/spec.md, Quantised states)",
            flush=True,
        )
    result = hf_models.compare(
        model, ids, args.new_tokens, config=config, null=not args.no_share, state_rounding=args.state_dtype
    )
    backend = ssu_backend(model)
    rows = [("transformers", result.reference), (f"ssu ({backend})", result.through_ssu)]
    if result.null_ssu is not None:
        rows.append(("zeros (no SSU)", result.null_ssu))
    layers = len(find_mixers(model))
    print(
        f"{'path':22s} {'ms/token':>9s} {'SSU ms/token':>13s} {'SSU share':>12s} {'SSU call us':>12s} "
        f"{'above zeros':>12s}"
    )

    def above_zeros(run) -> float:
        """Microseconds of a layer's SSU call in ``run`` above the zeros' own."""
        return (run.per_call - result.null_ssu.per_call) * 1e6

    for name, run in rows:
        ssu_time = share = above = "-"
        if result.null_ssu is not None and run is not result.null_ssu:
            ssu_time, share = ssu_share(run.step_seconds, result.null_ssu.step_seconds)
            above = f"{above_zeros(run):.1f}"
        print(
            f"{name:22s} {run.per_token * 1e3:9.3f} {ssu_time:>13s} {share:>12s} {run.per_call * 1e6:12.1f} "
            f"{above:>12s}"
        )
    if result.null_ssu is not None:
        kernel = hf_models.kernel_us(model, ids, config)
        print(
            f"one layer's SSU call in the decode steps through ssu: {above_zeros(result.through_ssu):.1f} us of host "
            "time above the zeros "
            f"({counted(len(result.through_ssu.call_seconds), 'call')} of {counted(layers, 'layer')})"
            + ("" if kernel is None else f"; ssu's kernel alone: {kernel:.1f} us on the device (CUDA-graph replays)")
        )
    total = result.reference.logits.shape[0] * result.reference.logits.shape[1]
    equal = round(result.agreement * total)
    first = result.first_divergence()
    print(
        f"tokens: {equal}/{total} equal ({100 * result.agreement:.1f} %); largest logit difference "
        f"{result.max_logit_difference():.2e}" + ("" if first is None else " up to the first divergence")
    )
    if first is not None:
        verdict = (
            "within rounding: transformers' own top-two logits there are closer than the paths differ"
            if result.divergence_within_rounding()
            else "NOT explained by rounding"
        )
        print(f"first divergence: sequence {first[0]}, token {first[1]}: {verdict}")
    print(
        "(ms/token: the median decode step after the first token, over 3 turns of each path; SSU ms/token and "
        f"share: its difference from a run whose SSU returns zeros, which moves with the host ({NOISE}: not "
        "larger than half the interquartile range of either run's step times); SSU call us: the "
        "median host time of a layer's one-token SSU call where the mixer makes it; above zeros: that less the "
        "zeros' own)"
    )
    return EXIT_OK if result.divergence_within_rounding() else EXIT_WRONG


def step_spread(seconds: Sequence[float]) -> float:
    """Half the interquartile range of a run's step times: how far its steps scatter with the host,
    the least a difference of two runs' medians must exceed to be the SSU's and not the noise's."""
    if len(seconds) < 2:
        return 0.0
    low, _, high = statistics.quantiles(seconds, n=4, method="inclusive")
    return (high - low) / 2


def ssu_share(steps: Sequence[float], zeros: Sequence[float]) -> tuple[str, str]:
    """The "SSU ms/token" and "SSU share" cells of a run whose decode steps took ``steps``
    seconds, against the run whose SSU returns zeros (``zeros``): the difference of their median
    step times and its share of the run's median, or :data:`NOISE` in both where that difference
    is within either run's :func:`step_spread` (a negative one always: no SSU takes less than no
    time, so the host's drift made it)."""
    per_token = statistics.median(steps)
    spent = per_token - statistics.median(zeros)
    if spent <= max(step_spread(steps), step_spread(zeros)):
        return NOISE, NOISE
    return f"{spent * 1e3:.3f}", f"{100 * spent / per_token:.0f} %"


def ssu_backend(model) -> str:
    """The backend the patched mixers used (from the drop-in's kernels), or the configured one."""
    from ..dropin import cache as dropin

    names = sorted({kernel.backend for kernel in dropin._kernels.values()})
    return ", ".join(names) or "?"
