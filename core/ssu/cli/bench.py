"""``ssu bench``: which backend is fastest for a model's shapes on this GPU, at the batches served."""

from __future__ import annotations

import datetime
import platform
import sys

from .bench_options import MEASURING, Measuring, check_installed, check_measuring
from .problem_args import INPUT_NAMES, MODELS, STATE_NAMES, check_device, in_option_words, require_device
from .usage import UsageError, spoken

EXIT_OK = 0


def add_bench_parser(sub) -> None:
    """Register ``ssu bench`` and its options on the CLI's subcommand table."""
    p = sub.add_parser("bench", help="time every available backend on this GPU across batches; table, plot, advice")
    g = p.add_argument_group("problem (defaults: Nemotron-H-8B head shapes)")
    g.add_argument(
        "--model",
        choices=sorted(MODELS),
        help="head shapes of a real model (default nemotron-h-8b; a --device cpu smoke run: H=4 P=8 N=16 G=2)",
    )
    g.add_argument("--nheads", type=int, help="H, heads (per tensor-parallel rank)")
    g.add_argument("--headdim", type=int, help="P, head dimension")
    g.add_argument("--dstate", type=int, help="N, state dimension")
    g.add_argument("--ngroups", type=int, help="G, B/C groups")
    g.add_argument(
        "--state-dtype",
        default=MEASURING["state_dtype"],
        help=f"state cache dtype(s), comma-separated: {STATE_NAMES} (with --engine: fp32, bf16, fp16; default fp32)",
    )
    g.add_argument("--input-dtype", default=MEASURING["input_dtype"], help=f"input dtype: {INPUT_NAMES} (default bf16)")
    g.add_argument(
        "--tokens", type=int, default=MEASURING["tokens"], help="tokens per sequence per step; > 1: step + commit"
    )
    g.add_argument(
        "--call",
        choices=("step", "packed", "verify"),
        default=MEASURING["call"],
        help="what to time: ssu's step (default), or an engine's call form on an adopted cache: packed (vLLM's, "
        "up to --tokens a sequence), verify (SGLang's, --tokens a row into an intermediate buffer)",
    )
    e = p.add_argument_group("against an engine's own kernel")
    e.add_argument(
        "--engine",
        choices=("vllm", "sglang"),
        help="time the engine's own SSU kernel beside every available ssu backend, on the engine's own decode and "
        "speculative calls (vLLM's packed call, SGLang's verify call; T = 4), through the drop-in as the engine "
        "plugins call it; each cell checked against the engine's kernel first",
    )
    e.add_argument(
        "--engine-wheel",
        metavar="PATH",
        help="with --engine: load the engine's kernel from its wheel (pip download --no-deps vllm==0.34.0) or a "
        "folder of its files (scripts/engine-kernels) instead of the installed engine",
    )
    p.add_argument("--batches", help="batch sizes (default 1,8,32,128,256,512; a --device cpu smoke run: 1,2)")
    p.add_argument(
        "--backends", default=MEASURING["backends"], help="comma-separated names, or all (every available backend)"
    )
    p.add_argument("--config", help="take the backends' options from this ssu.toml / pyproject.toml")
    p.add_argument("--adopt", action="store_true", help="time steps on an adopted engine cache as well")
    p.add_argument(
        "--iterations", type=int, default=MEASURING["iterations"], help="launches per captured CUDA graph (default 40)"
    )
    p.add_argument(
        "--device",
        default=None,
        help="cuda (default) or cuda:N; cpu: a smoke run of seconds (small shapes, wall-clock times, no advice)",
    )
    p.add_argument("--out", help="folder for bench.json, bench.png and bench.txt (made if missing; checked first)")
    p.add_argument(
        "--from",
        dest="saved",
        metavar="BENCH.json",
        help="measure nothing: render a saved run again (table, plot, advice), e.g. on a machine without a GPU",
    )
    p.add_argument(
        "--ceiling", type=float, help="with --from only: the copy ceiling in TB/s to state the rows against (> 0)"
    )


#: the head shapes of a CPU smoke run where none are given: a run of seconds, not a model's
SMOKE_SHAPES = dict(nheads=4, headdim=8, dstate=16, ngroups=2)
SMOKE_BATCHES, GPU_BATCHES = "1,2", "1,8,32,128,256,512"


def _problem_fields(args, smoke: bool = False) -> dict:
    given = args.model is not None or any(getattr(args, key) is not None for key in SMOKE_SHAPES)
    fields = dict(SMOKE_SHAPES) if smoke and not given else dict(MODELS[args.model or "nemotron-h-8b"])
    for key in fields:
        if getattr(args, key) is not None:
            if getattr(args, key) < 1:
                raise UsageError(f"--{key} must be at least 1, got {getattr(args, key)}")
            fields[key] = getattr(args, key)
    return fields


def _candidates(args, m: Measuring, fields, config, device, required: bool = True) -> tuple[list, dict]:
    """The backends to time, and the reason for each not timed (its ``explain`` verdict); none to
    time is a usage error with each one's reason, before anything is timed."""
    from ..contract.errors import SSUError
    from ..contract.problem import Problem
    from ..plugins.registry import default_registry
    from ..plugins.resolve import explain

    registry = default_registry()
    installed = sorted(registry.discover())
    if m.backends is not None:
        check_installed(m.backends, installed)
    wanted = [n for n in installed if n != "reference" or device == "cpu"] if m.backends is None else m.backends
    chosen, refused = [], {}
    for name in wanted:
        try:
            problem = Problem(
                **fields,
                state_dtype=m.states[0],
                input_dtype=m.input_dtype,
                num_slots=2,
                max_batch=1,
                tokens_per_step=args.tokens,
                speculative=args.tokens > 1 and args.call == "step",
                device=device,
                engine_calls=() if args.call == "step" else (args.call,),
                engine_state=args.call != "step",
            )
        except SSUError as exc:
            raise UsageError(in_option_words(str(exc))) from None
        verdict = explain(config.with_backend(name, "ssu bench"), problem, registry)
        if verdict.selected == name:
            chosen.append(name)
        else:
            refused[name] = next((c.reason for c in verdict.trace if c.name == name), "not available")
    if required and not chosen:
        named = f"--backends {args.backends}: " if m.backends is not None else ""
        why = "; ".join(f"{name}: {' '.join(spoken(reason).split())}" for name, reason in refused.items())
        raise UsageError(f"{named}no backend to time here ({why or 'none installed'})")
    return chosen, refused


def cmd_bench(args, timer=None) -> int:
    """Run the benchmark; ``timer`` replaces the CUDA-graph timing (tests)."""
    import torch

    from ..bench import measure, report
    from ..plugins.config import load_config
    from ..contract.errors import SSUError

    if args.saved:
        from .bench_saved import render_saved

        return render_saved(args)
    m = check_measuring(args)
    if args.engine:
        return _bench_engine(args, m, timer)
    device = args.device or "cuda"
    check_device(device)
    if device.startswith("cuda") and not torch.cuda.is_available() and timer is None:
        raise UsageError(
            "ssu bench times GPU kernels and this machine has no CUDA device; run it on the GPU you "
            "serve from (--device cpu is a smoke run of wall-clock times: the reference, and the triton "
            "backends in Triton's interpreter when TRITON_INTERPRET=1 is set)"
        )
    if device.startswith("cuda") and timer is None:
        require_device(device)  # an index past the last GPU
    smoke = not device.startswith("cuda")
    batches = m.batches or report.parse_batches(SMOKE_BATCHES if smoke else GPU_BATCHES)
    states = m.states
    fields = _problem_fields(args, smoke)
    config = load_config(args.config)
    if "flashinfer-replayssm" not in config.backends:  # its one-kernel path; autotuning each batch takes minutes
        import attrs

        config = attrs.evolve(
            config, backends={**config.backends, "flashinfer-replayssm": {"autotune": False, "algorithm": "monolith"}}
        )
    chosen, refused = _candidates(args, m, fields, config, device)
    if smoke:
        timer = timer or measure.wall_time_us
        interpreted = [n for n in chosen if n.startswith("triton")]
        how = f"wall-clock times of {', '.join(chosen) or 'no backend'}" + (
            f" ({', '.join(interpreted)} in Triton's interpreter)" if interpreted else ""
        )
        on = f"a CPU smoke run ({how}; not a benchmark)"
    else:
        on = torch.cuda.get_device_name(device) if timer is None else "a fake timer"
    calls = {"step": "", "packed": ", vLLM's packed call", "verify": ", SGLang's verify call"}
    title = (
        f"ssu bench {datetime.date.today()}, {on}: H={fields['nheads']} P={fields['headdim']} "
        f"N={fields['dstate']} G={fields['ngroups']}, input {m.input_dtype}, T={args.tokens}{calls[args.call]}"
    )
    print(title, flush=True)
    ceiling = None if smoke else measure.copy_ceiling_tbps(device, timer=timer)
    if ceiling:
        print(f"copy ceiling of this GPU: {ceiling:.2f} TB/s (read + write)", flush=True)
    rows = []
    from ..plugins.registry import default_registry

    adopting = {name for name in chosen if default_registry().load(name).spec.capabilities.adopt_state}
    if args.adopt:
        for name in sorted(set(chosen) - adopting):
            refused[f"{name} (adopted cache)"] = "steps only states it allocates (no adopt_state capability)"
    plan = [
        (state, batch, name, adopt)
        for state in states
        for batch in batches
        for name in chosen
        for adopt in ((False, True) if args.adopt and name in adopting else (False,))
    ]
    for done, (state, batch, name, adopt) in enumerate(plan, 1):
        case = measure.Case(
            name,
            fields["nheads"],
            fields["headdim"],
            fields["dstate"],
            fields["ngroups"],
            state,
            m.input_dtype,
            args.tokens,
            batch,
            adopt,
            args.call,
        )
        label = f"[{done}/{len(plan)}] {name}{' (adopted cache)' if adopt else ''} state {state} batch {batch}"
        print(f"  {label}: warming up and timing ...", end="", flush=True, file=sys.stderr)
        try:
            row = measure.measure(case, config, device=device, iterations=args.iterations, timer=timer)
        except SSUError as exc:
            print(" skipped", file=sys.stderr)
            refused[f"{name} (state {state}, batch {batch})"] = str(exc)
            continue
        print(f" {row.us:.1f} us", file=sys.stderr, flush=True)
        rows.append(row)
        if not smoke:
            torch.cuda.empty_cache()
    if args.adopt:  # the table compares adopted and owned states as two entries
        rows = [attrs_evolve_backend(r) for r in rows]
    refused = {name: spoken(reason) for name, reason in refused.items()}
    text = report.table(rows, ceiling, refused, smoke=smoke)
    spans = report.recommend([r for r in rows if not r.case.adopt or not args.adopt])
    advice = report.advice(spans, rows) if not smoke else report.SMOKE_ADVICE
    print(text)
    print()
    print(advice)
    if args.out:
        from pathlib import Path

        from .bench_saved import write_out

        out = Path(args.out)
        meta = dict(
            title=title,
            date=str(datetime.date.today()),
            device=on,
            ceiling_tbps=ceiling,
            torch=torch.__version__,
            python=platform.python_version(),
            versions=_versions(chosen),
        )
        plotted = write_out(args.out, title, text, advice, rows, meta, refused, spans)
        no_plot = (
            " (no plot: pip install 'ssu-core[bench]' for matplotlib)" if plotted is False else " (no plot: no row)"
        )
        print(f"\nwrote {out / 'bench.txt'}, {out / 'bench.json'}" + (f", {out / 'bench.png'}" if plotted else no_plot))
    return EXIT_OK


def _bench_engine(args, m: Measuring, timer=None) -> int:
    """``--engine``: the engine's own kernel and every available ssu backend on the engine's calls."""
    import json
    from pathlib import Path

    import torch

    from ..bench import engine_kernels, engines, measure, report
    from ..contract.errors import SSUError
    from ..measure.timing import graph_time_us

    device = args.device or "cuda"
    check_device(device)
    smoke = not device.startswith("cuda")
    if not smoke and timer is None:
        if not torch.cuda.is_available():
            raise UsageError("ssu bench --engine times GPU kernels and this machine has no CUDA device (--device cpu "
                             "is a smoke run in Triton's interpreter, TRITON_INTERPRET=1)")  # fmt: skip
        require_device(device)
    try:
        kernel = engine_kernels.load(args.engine, args.engine_wheel)
    except engine_kernels.EngineKernelError as exc:
        raise UsageError(str(exc)) from None
    batches = m.batches or report.parse_batches(SMOKE_BATCHES if smoke else GPU_BATCHES)
    states = m.states
    shapes = _problem_fields(args, smoke)
    from ..plugins.config import load_config

    config = load_config(args.config)
    from ..plugins.preflight import engine_refusal
    from ..plugins.registry import default_registry

    registry = default_registry()
    unfit = {}  # installed backends an engine plugin cannot be configured with
    for name in registry.discover():
        try:
            why = engine_refusal(registry.load(name))
        except SSUError:
            continue
        if why:
            unfit[name] = why
    serving, refused = {}, dict(unfit)  # the ssu backends that serve each of the engine's call forms
    for form in engines.FORMS[args.engine]:
        call = "packed" if form == "speculative" else ("tree" if form == "verify" else "step")
        tokens = engines.SPECULATIVE_TOKENS if call != "step" else 1
        chosen, why = _candidates(type(args)(**dict(vars(args), call=call, tokens=tokens)), m, shapes, config,
                                  device, required=False)  # fmt: skip
        serving[form] = [n for n in chosen if (n != "reference" or smoke) and n not in unfit]
        refused.update({f"{name} ({form})": reason for name, reason in why.items() if name not in unfit})
    name = args.engine
    ours = sorted({n for chosen in serving.values() for n in chosen})
    contenders = [name, *ours]
    # one configuration per backend for the whole run, as a plugin has: the drop-in keeps its
    # kernels per configuration, so each cell finds the kernel an earlier cell opened and tuned
    calls_of = {backend: engines.drop_in(backend) for backend in ours}
    timer = timer or (measure.wall_time_us if smoke else graph_time_us)
    on = "a CPU smoke run (wall-clock times, Triton's interpreter; not a benchmark)" if smoke else (
        torch.cuda.get_device_name(device))  # fmt: skip
    title = (
        f"ssu bench --engine {name} {datetime.date.today()}, {on}: H={shapes['nheads']} P={shapes['headdim']} "
        f"N={shapes['dstate']} G={shapes['ngroups']}, input {m.input_dtype}; {name} {kernel.version}'s "
        f"selective_state_update ({kernel.loaded})"
    )
    print(title, flush=True)
    ceiling = None if smoke else measure.copy_ceiling_tbps(device, timer=None if timer is graph_time_us else timer)
    if ceiling:
        print(f"copy ceiling of this GPU: {ceiling:.2f} TB/s (read + write)", flush=True)
    cells, mismatches = [], []
    plan = [(form, state, batch) for form in engines.FORMS[name] for state in states for batch in batches]
    for done, (form, state, batch) in enumerate(plan, 1):
        print(f"  [{done}/{len(plan)}] {form} state {state} batch {batch} ...", end="", flush=True, file=sys.stderr)
        built = engines.build(name, form, shapes, state, m.input_dtype, batch, device)
        tokens = engines.SPECULATIVE_TOKENS if form != "decode" else 1
        budget = engines.budgets(state, m.input_dtype, tokens)
        times, differences = [], []
        for contender in [name, *serving[form]]:
            fn = kernel.call if contender == name else calls_of[contender]
            if contender != name:
                try:
                    out_diff, state_diff = engines.compare(name, form, built, kernel.call, fn)
                except SSUError as exc:
                    refused[f"{contender} ({form}, state {state}, batch {batch})"] = str(exc)
                    continue
                differences.append((contender, out_diff, state_diff))
                if out_diff > budget[0] or state_diff > budget[1]:
                    mismatches.append(f"{contender} {form} state {state} batch {batch}: outputs {out_diff:.2e}, "
                                      f"states {state_diff:.2e} from {name}'s (budgets {budget[0]:.1e}, "
                                      f"{budget[1]:.1e})")  # fmt: skip
                    continue
            launches = [(lambda fn=fn, call=call, cache=built.state: fn(cache, **call)) for call in built.sets]
            times.append((contender, timer(launches, min_launches=args.iterations)))
        cells.append(engines.Cell(name, form, state, batch, tokens, tuple(times), built.floor_bytes,
                                  tuple(differences)))  # fmt: skip
        print(" " + ", ".join(f"{c} {us:.1f} us" for c, us in times), file=sys.stderr, flush=True)
        del built
        if not smoke:
            torch.cuda.empty_cache()
    text = engines.table(cells, contenders, name, ceiling)
    print(text)
    for line in mismatches:
        print(f"MISMATCH (not timed): {line}")
    for what, reason in refused.items():
        print(f"not timed: {what}: {spoken(reason)}")
    if args.out:
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench-engine.txt").write_text(f"{title}\n{text}\n")
            meta = dict(title=title, date=str(datetime.date.today()), device=on, ceiling_tbps=ceiling,
                        engine=dict(name=name, version=kernel.version, loaded=kernel.loaded), torch=torch.__version__,
                        python=platform.python_version(), versions=_versions(ours))  # fmt: skip
            rows = [c.to_dict() for c in cells]
            (out / "bench-engine.json").write_text(json.dumps(dict(meta, cells=rows, mismatches=mismatches,
                                                                   refused=refused), indent=1))  # fmt: skip
        except OSError as exc:
            raise UsageError(f"cannot write to --out {args.out}: {exc.strerror or exc}") from None
    return EXIT_OK if not mismatches else 1


def attrs_evolve_backend(row):
    """A row of an adopted-cache measurement, named ``backend+adopted`` in the table."""
    import attrs

    if not row.case.adopt:
        return row
    return attrs.evolve(row, case=attrs.evolve(row.case, backend=f"{row.case.backend}+adopted"))


def _versions(backends) -> dict:
    import importlib.metadata

    found = {}
    for dist in ("ssu-core", "triton", "flashinfer-python", *[f"ssu-backend-{b}" for b in backends]):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found
