"""``ssu``: list backends, explain a choice, check a config, run a decode, verify a backend.

Exit codes: 0 ok, 1 results wrong, 2 usage or config error, 3 internal error (an exception ssu
did not expect: a bug in ssu or a backend). Errors print one line each with its remedy, never a
traceback (``SSU_DEBUG=1`` shows tracebacks).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from typing import Optional, Sequence

from ..contract.errors import SSUError
from .problem_args import add_problem_args, check_device, dtype_options, problem_from_args, require_device
from ..contract.errors import counted
from .usage import Parser, UsageError, spoken

EXIT_OK, EXIT_WRONG, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def _version() -> str:
    from ..contract.records import CORE_VERSION, PLUGIN_API_VERSION

    return f"ssu {CORE_VERSION} (ssu-core, plugin API {PLUGIN_API_VERSION})"


def _parser() -> Parser:
    parser = Parser(prog="ssu", description="Mamba2 selective state update: backends and checks.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    sub.required = True

    p = sub.add_parser("backends", help="list installed backends with status and capabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--device", default=None, help="device to probe availability on (default: cuda if present, else cpu)"
    )
    p.add_argument("--no-probe", action="store_true", help="read metadata only: import no backend")

    p = sub.add_parser("explain", help="which backend would serve a problem, and every other backend's verdict")
    p.add_argument("--config", help="ssu.toml or pyproject.toml (default: search the working directory)")
    p.add_argument("--backend", help="backend name, comma-separated fallback list, or auto")
    add_problem_args(p)

    p = sub.add_parser("check-config", help="validate a config file: names of installed backends and their options")
    p.add_argument("file", nargs="?", help="ssu.toml or pyproject.toml (default: the file ssu.load_config() finds)")

    p = sub.add_parser("run", help="decode run over a Mamba2 stack, checked against the oracle (the main job)")
    p.add_argument("--config", help="ssu.toml or pyproject.toml (default: search the working directory)")
    p.add_argument("--backend", help="backend name, comma-separated fallback list, or auto")
    p.add_argument("--layers", type=int, default=4, help="layers in the stack (default 4)")
    p.add_argument("--steps", type=int, default=12, help="decode steps (default 12)")
    p.add_argument("--pad-rows", type=int, default=0, help="padded rows in the batch (default 0)")
    p.add_argument("--check-every", type=int, default=1, help="check against the oracle every K steps; 0: never")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and states (default 0)")
    add_problem_args(p)

    p = sub.add_parser("verify", help="run the conformance checks on a backend, here")
    p.add_argument("--config", help="take the backend and its options from this file")
    p.add_argument("--backend", help="backend to check (default: the configured one; auto: what auto selects)")
    p.add_argument(
        "--device", default=None, help="device (default: cuda if the backend supports it and one is present)"
    )
    p.add_argument(
        "--profile",
        choices=("smoke", "quick", "default", "thorough"),
        default=None,
        help="how much to cover: smoke (tiny, T <= 4: for interpreters), quick (small shapes; the default "
        "on the CPU), default (real model shapes, long decodes; the default on CUDA), thorough",
    )
    p.add_argument("--examples", type=int, help="problems drawn per check (default: the profile's)")
    p.add_argument("--check", action="append", dest="checks", metavar="NAME", help="run only this check (repeatable)")
    p.add_argument(
        "--state-dtype",
        dest="state_dtypes",
        metavar="DTYPES",
        help="draw problems of these state dtypes only, comma-separated (each one the backend declares): "
        "fp32, bf16, fp16, int8, fp8_e4m3",
    )

    p = sub.add_parser("new-backend", help="write a ready-to-install backend distribution (passes the suite as is)")
    p.add_argument("name", help="backend name, e.g. mykernel (the distribution is ssu-backend-NAME)")
    p.add_argument("--dir", default=".", help="where to create ssu-backend-NAME/ (default: here)")
    p.add_argument("--force", action="store_true", help="overwrite an existing, non-empty folder")

    from .bench import add_bench_parser
    from .compare import add_compare_parser

    add_compare_parser(sub)
    add_bench_parser(sub)
    return parser


def _default_device(devices=("cpu", "cuda")) -> str:
    if "cuda" in devices:
        try:
            import torch

            if torch.cuda.is_available():
                return "cuda"
        except ImportError:  # pragma: no cover
            pass
    return "cpu"


def cmd_backends(args) -> int:
    """List the installed backends, their capabilities and (unless --no-probe) whether each runs on the device."""
    from ..plugins.registry import list_backends

    device = args.device or ("cpu" if args.no_probe else _default_device())
    if args.device:
        check_device(args.device)
    infos = list_backends(probe=not args.no_probe, device=device)
    if args.json:
        print(json.dumps({"device": device, "backends": [i.to_dict() for i in infos]}, indent=2))
        return EXIT_OK
    print(f"backends (probed on {device}):" if not args.no_probe else "backends (metadata only):")
    for info in infos:
        print(f"  {info.name:22s} {info.status:12s} {info.distribution} {info.version}")
        if info.description:
            print(f"      {info.description}")
        if info.reason:
            print(f"      reason: {spoken(info.reason)}")
        if info.capabilities is not None:
            c = info.capabilities
            extras = [
                name
                for name, on in (
                    ("speculative", c.speculative),
                    ("cuda graphs", c.cuda_graphs),
                    ("adopts engine caches", c.adopt_state),
                    ("destination slots", c.destination_slots),
                    ("contiguous rows only", c.contiguous_rows),
                    (f"states at {c.state_precision} precision", c.state_precision is not None),
                )
                if on
            ]
            print(
                f"      devices {','.join(sorted(c.devices))}; state {','.join(sorted(c.state_dtypes))}; "
                f"inputs {','.join(sorted(c.input_dtypes))}; tokens/step <= {c.max_tokens_per_step}"
                + "".join(f"; {e}" for e in extras)
            )
    return EXIT_OK


def _config(args):
    from ..plugins.config import load_config

    return load_config(args.config, backend=args.backend)


def cmd_explain(args) -> int:
    """Print, backend by backend, why the configuration resolves to the backend it selects for the
    problem. The problem passes ``ssu run``'s checks of its sizes first (a batch its slots can hold,
    one layer's state within the device's memory); where no backend is selected, the error ``ssu
    run`` would give goes to stderr too, and the exit code is 2, as run's."""
    from ..plugins.registry import default_registry
    from ..plugins.resolve import explain, resolve
    from .sizes import check_layer_fits, check_slots

    config = _config(args)
    problem = problem_from_args(args)
    check_slots(problem, args.batch)
    check_layer_fits(problem)
    registry = default_registry()
    resolution = explain(config, problem, registry)
    print(spoken(resolution.explain()), flush=True)
    if resolution.selected:
        return EXIT_OK
    resolve(config, problem, registry)  # raises the refusal `ssu run` prints, for main to print
    return EXIT_USAGE  # pragma: no cover - resolve refused above


def toml_value(value) -> str:
    """``value`` as a TOML file spells it: ``true``/``false``, a quoted string, a list of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(toml_value(v) for v in value)}]"
    return json.dumps(value)  # a JSON string is a TOML basic string


def _settings(config) -> str:
    """The configuration's backend and validate keys as TOML lines would set them, on one line."""
    return f"backend = {toml_value(config.backend)}, validate = {toml_value(config.validate)}"


def cmd_check_config(args) -> int:
    """Check a configuration file without running a kernel: backend names, option tables, option values."""
    from ..plugins.config import Config, find_config_file, load_config
    from ..contract.errors import (
        BackendBrokenError,
        BackendDisabledError,
        BackendError,
        BackendIncompatibleError,
        ConfigError,
    )
    from ..plugins.registry import default_registry
    from ..plugins.resolve import check_backend_names, check_option_tables, validated_options

    path = args.file
    if path is None:
        found = find_config_file()
        if found is None:
            print(
                f"no config file in {os.getcwd()} (ssu.toml, or pyproject.toml with [tool.ssu]): the defaults "
                f"apply ({_settings(Config())})"
            )
            return EXIT_OK
        path = str(found)
    config = load_config(path, env={}, search=False)
    registry = default_registry()
    try:
        check_backend_names(config, registry)
    except BackendError as exc:
        raise ConfigError(f"{path}: backend: {exc}") from None
    check_option_tables(config, registry)
    installed = registry.discover()
    notes = []
    for name in config.candidates:  # a backend the file selects must import, as `ssu run` needs it to
        if name not in installed:
            continue
        try:
            registry.load(name)
        except (BackendBrokenError, BackendIncompatibleError) as exc:
            raise type(exc)(f"{path}: backend: {exc}") from None
        except BackendDisabledError as exc:  # switched off here by SSU_PLUGINS / SSU_DISABLE_PLUGINS
            if name not in config.backends:  # else the options' note below says it
                notes.append(str(exc))
    for name in config.backends:
        if name not in installed:
            notes.append(f"options for {name!r} not checked: that backend is not installed")
            continue
        try:
            validated_options(registry.load(name), config)  # an error names the file and the option
        except BackendError as exc:
            notes.append(f"options for {name!r} not checked: {exc}")
    print(f"{path}: OK ({_settings(config)})")
    for note in notes:
        print(f"  note: {note}")
    return EXIT_OK


def _check_run_args(args, problem) -> None:
    from .sizes import check_slots

    for name in ("layers", "steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.check_every < 0:
        raise UsageError(f"--check-every must be 0 (never) or more, got {args.check_every}")
    if not 0 <= args.pad_rows < args.batch:
        raise UsageError(
            f"--pad-rows must be 0 to {args.batch - 1} (at least one real row of --batch {args.batch}), "
            f"got {args.pad_rows}"
        )
    check_slots(problem, args.batch, args.pad_rows)


def cmd_run(args) -> int:
    """Decode random inputs through the selected backend and compare them with the reference as they run."""
    from .decode import decode_run
    from ..runtime.kernel import open_kernel
    from .progress import Progress
    from .sizes import check_run_memory

    require_device(args.device)
    problem = problem_from_args(args)
    _check_run_args(args, problem)
    check_run_memory(problem, args.layers, checked=args.check_every > 0)
    kernel = open_kernel(_config(args), problem)
    print(f"ssu run: backend {kernel.backend} ({kernel.distribution}); {problem.describe()}", flush=True)
    bar = Progress(args.steps, "decode")
    try:
        report = decode_run(
            kernel,
            layers=args.layers,
            steps=args.steps,
            batch=args.batch,
            seed=args.seed,
            pad_rows=args.pad_rows,
            check_every=args.check_every,
            progress=bar,
        )
    finally:
        bar.close()
    print(report.summary())
    return EXIT_OK if report.ok else EXIT_WRONG


def _verified_backend(config, registry, device: Optional[str]) -> tuple[str, str]:
    """(backend, device) to verify: the configured name, or for a list or ``auto`` the first
    candidate available here, as resolution would try them."""
    from ..plugins.config import AUTO
    from ..contract.errors import BackendUnavailableError
    from ..plugins.resolve import auto_order

    names = auto_order(registry, []) if config.candidates == (AUTO,) else list(config.candidates)
    reasons = []
    for name in names:
        loaded = registry.load(name)
        here = device or _default_device(loaded.spec.capabilities.devices)
        availability = loaded.probe(here)
        if availability.available:
            return name, here
        reasons.append(f"backend {name!r} is unavailable on {here}: {availability.message()}")
    if len(reasons) == 1:
        raise BackendUnavailableError(reasons[0])
    raise BackendUnavailableError(f"no backend of {', '.join(config.candidates)} can run here: " + "; ".join(reasons))


def _state_dtypes(names: Optional[list], capabilities, backend: str):
    """``--state-dtype``'s dtypes (None when not given), each declared by the backend."""
    from ..conformance.runner import narrowed

    if names is None:
        return None
    try:
        narrowed(capabilities, names, backend)
    except ValueError as exc:
        raise UsageError(f"--state-dtype {','.join(names)}: {exc}") from None
    return names


def cmd_verify(args) -> int:
    """Run the conformance checks on one backend and print what each ran, passed, skipped or failed."""
    import importlib.util

    if importlib.util.find_spec("hypothesis") is None:
        raise UsageError("ssu verify draws its cases with hypothesis: pip install 'ssu-core[test]'")
    from ..conformance import CHECKS, PROFILES, run_conformance
    from ..conformance.runner import device_profile
    from ..contract.dtypes import STATE_DTYPES
    from ..plugins.registry import default_registry

    if args.device:
        check_device(args.device)
    names = None
    if args.state_dtypes is not None:
        names = dtype_options(args.state_dtypes, "--state-dtype", STATE_DTYPES, "a state cache dtype")
    unknown = [c for c in args.checks or [] if c not in CHECKS]
    if unknown:
        raise UsageError(f"--check {unknown[0]}: no such check; the checks are {', '.join(CHECKS)}")
    if args.examples is not None and args.examples < 1:
        raise UsageError(f"--examples {args.examples}: give a positive number")
    config = _config(args)
    registry = default_registry()
    name, device = _verified_backend(config, registry, args.device)
    state_dtypes = _state_dtypes(names, registry.load(name).spec.capabilities, name)
    chosen = "" if config.candidates == (name,) else f" (from {', '.join(config.candidates)})"
    why = ""
    if args.profile is None:  # the device's profile, saying so and naming the larger ones
        profile_name, why = device_profile(device)
        larger = list(PROFILES)[list(PROFILES).index(profile_name) + 1 :]
        if larger:
            why += "; for more: " + ", ".join(f"--profile {p}" for p in larger)
        why = ", " + why
    profile = PROFILES[args.profile or profile_name]
    examples = args.examples or profile.examples
    print(
        f"ssu verify: backend {name}{chosen} on {device}, profile {profile.name} "
        f"({counted(examples, 'drawn problem')} per check, {counted(profile.real_shapes, 'real model shape')}, "
        f"decodes of {counted(profile.decode_steps, 'step')}"
        + (f", T capped at {profile.max_tokens}" if profile.max_tokens is not None else "")
        + (", corner cases" if profile.corners else "")
        + ")"
        + why,
        flush=True,
    )

    def start(check: str) -> None:
        print(f"  RUN   {check:15s} {CHECKS[check].what}", flush=True)

    def show(report) -> None:
        print(f"  {report.status.upper():4s}  {report.check:15s} {CHECKS[report.check].what} ({report.seconds:.1f} s)")
        if report.ran:
            print(f"        ran {report.coverage()}")
        for reason, count in report.refused:
            print(f"        refused by the backend ({count}x): {spoken(reason)}")
        if report.status == "skip":
            print(f"        skipped: {spoken(report.detail)}")
        elif report.skipped:
            for reason, count in report.skipped:
                print(f"        not applicable ({count}x): {reason}")
        if report.failure:
            for line in report.failure.splitlines():
                print(f"        {line}")
        sys.stdout.flush()

    reports = run_conformance(
        name,
        device=device,
        registry=registry,
        options=config.options_for(name),
        profile=profile,
        checks=args.checks,
        max_examples=args.examples,
        on_report=show,
        state_dtypes=state_dtypes,
        on_start=start,
    )
    failed = sum(r.status == "fail" for r in reports)
    skipped = sum(r.status == "skip" for r in reports)
    print(f"{len(reports) - failed - skipped} passed, {failed} failed, {skipped} skipped")
    return EXIT_WRONG if failed else EXIT_OK


def cmd_new_backend(args) -> int:
    """Write a new backend distribution from the scaffold and print the commands that test it."""
    from .scaffold import module_name, write_backend

    root = write_backend(args.name, args.dir, force=args.force)
    print(f"wrote {root}/ (backend {args.name!r}, module {module_name(args.name)})")
    print(f'next: pip install -e "{root}[test]" && (cd {root} && pytest)')
    return EXIT_OK


def _commands() -> dict:
    from .bench import cmd_bench
    from .compare import cmd_compare

    return {
        "new-backend": cmd_new_backend,
        "backends": cmd_backends,
        "explain": cmd_explain,
        "check-config": cmd_check_config,
        "run": cmd_run,
        "verify": cmd_verify,
        "compare": cmd_compare,
        "bench": cmd_bench,
    }


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """ssu's own warnings as one line (``ssu: warning: ...``), others as Python prints them."""
    from ..contract.errors import SSUWarning

    if issubclass(category, SSUWarning):
        print(f"ssu: warning: {message}", file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def error_lines(prefix: str, message: str) -> str:
    """An error message as the command line prints it: each of its lines that starts a problem of
    its own (a config table's several bad options) behind ``prefix``, one line per problem; an
    indented line (a detail, such as each rejected backend of a resolution) stays under the line
    before it, indented."""
    lines = message.splitlines() or [""]
    return "\n".join(f"  {line}" if line[:1].isspace() else f"{prefix}{line}" for line in lines)


def internal_error(command: str, exc: BaseException) -> str:
    """The line an exception ssu did not expect prints: that it is an internal error, where it
    was raised (the innermost frame: ssu's or a backend's file), and what to report where."""
    import importlib.metadata
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {_short_path(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    text = str(exc).strip().splitlines()
    what = type(exc).__name__ + (f": {text[0]}" if text else "")
    try:
        urls = importlib.metadata.metadata("ssu-core").get_all("Project-URL") or []
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a source tree on sys.path
        urls = []
    issues = next((url.split(",", 1)[1].strip() for url in urls if url.lower().startswith("issues,")), None)
    to = f" to {issues}" if issues else ""
    return (
        f"ssu {command}: internal error (a bug in ssu or a backend, not in what you gave): {what}{where}; "
        f"report it{to} with the command line and the traceback that SSU_DEBUG=1 prints"
    )


def _short_path(filename: str) -> str:
    """``filename`` from its top package on (``ssu/cli/main.py``, ``torch/nn/functional.py``): the
    folders above it that hold an ``__init__.py``, else the path as it is."""
    folder, parts = os.path.dirname(filename), [os.path.basename(filename)]
    while folder and os.path.isfile(os.path.join(folder, "__init__.py")):
        folder, name = os.path.split(folder)
        parts.insert(0, name)
    return "/".join(parts) if len(parts) > 1 else filename


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``ssu`` command: parse, dispatch, and turn ssu's errors into messages and exit codes."""
    warnings.showwarning = _show_warning
    args = _parser().parse_args(argv)
    try:
        return _commands()[args.command](args)
    except SSUError as exc:
        if os.environ.get("SSU_DEBUG"):
            raise
        print(error_lines(f"ssu {args.command}: error: ", spoken(str(exc))), file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # the reader stopped reading (``ssu backends --json | head -1``): not an error
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except Exception as exc:  # anything else is ssu's (or a backend's) fault, never "results wrong"
        if os.environ.get("SSU_DEBUG"):
            raise
        print(internal_error(args.command, exc), file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
