"""``ssu``: list backends, explain a choice, check a config, run a decode, verify a backend.

Exit codes: 0 ok, 1 results wrong, 2 usage or config error. Errors print one message with its
remedy, never a traceback (``SSU_DEBUG=1`` shows tracebacks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from ..errors import SSUError
from .problem_args import add_problem_args, problem_from_args

EXIT_OK, EXIT_WRONG, EXIT_USAGE = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssu", description="Mamba2 selective state update: backends and checks.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("backends", help="list installed backends with status and capabilities")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--device", default=None, help="device to probe availability on (default: cuda if present, else cpu)")
    p.add_argument("--no-probe", action="store_true", help="read metadata only: import no backend")

    p = sub.add_parser("explain", help="which backend would serve a problem, and why not the others")
    p.add_argument("--config", help="ssu.toml or pyproject.toml (default: search the working directory)")
    p.add_argument("--backend", help="backend name, comma-separated fallback list, or auto")
    add_problem_args(p)

    p = sub.add_parser("check-config", help="validate a config file, including the options of installed backends")
    p.add_argument("file")

    p = sub.add_parser("run", help="decode run over a Mamba2 stack, checked against the oracle (the main job)")
    p.add_argument("--config", help="ssu.toml or pyproject.toml (default: search the working directory)")
    p.add_argument("--backend", help="backend name, comma-separated fallback list, or auto")
    p.add_argument("--layers", type=int, default=4, help="layers in the stack (default 4)")
    p.add_argument("--steps", type=int, default=12, help="decode steps (default 12)")
    p.add_argument("--pad-rows", type=int, default=0, help="padded rows in the batch (default 0)")
    p.add_argument("--check-every", type=int, default=1, help="check against the oracle every K steps; 0: never")
    p.add_argument("--seed", type=int, default=0)
    add_problem_args(p)

    p = sub.add_parser("verify", help="run the conformance checks on a backend, here")
    p.add_argument("--config", help="take the backend and its options from this file")
    p.add_argument("--backend", help="backend to check (default: the configured one)")
    p.add_argument("--device", default=None, help="device (default: cuda if the backend supports it and one is present)")

    p = sub.add_parser("new-backend", help="write a ready-to-install backend distribution (passes the suite as is)")
    p.add_argument("name", help="backend name, e.g. mykernel (the distribution is ssu-backend-NAME)")
    p.add_argument("--dir", default=".", help="where to create ssu-backend-NAME/ (default: here)")
    p.add_argument("--force", action="store_true", help="overwrite an existing, non-empty folder")
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
    from ..registry import list_backends

    device = args.device or ("cpu" if args.no_probe else _default_device())
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
            print(f"      reason: {info.reason}")
        if info.capabilities is not None:
            c = info.capabilities
            print(f"      devices {','.join(sorted(c.devices))}; state {','.join(sorted(c.state_dtypes))}; "
                  f"inputs {','.join(sorted(c.input_dtypes))}; tokens/step <= {c.max_tokens_per_step}"
                  f"{'; speculative' if c.speculative else ''}{'; cuda graphs' if c.cuda_graphs else ''}")
    return EXIT_OK


def _config(args):
    from ..config import load_config

    return load_config(args.config, backend=args.backend)


def cmd_explain(args) -> int:
    from ..registry import default_registry
    from ..resolve import explain

    resolution = explain(_config(args), problem_from_args(args), default_registry())
    print(resolution.explain())
    return EXIT_OK if resolution.selected else EXIT_USAGE


def cmd_check_config(args) -> int:
    from ..config import load_config
    from ..errors import BackendError
    from ..registry import default_registry
    from ..resolve import _check_option_tables, _options

    config = load_config(args.file, env={}, search=False)
    registry = default_registry()
    _check_option_tables(config, registry)
    notes = []
    for name in config.backends:
        if name not in registry.discover():
            notes.append(f"options for {name!r} not checked: that backend is not installed")
            continue
        try:
            _options(registry.load(name), config)
        except BackendError as exc:
            notes.append(f"options for {name!r} not checked: {exc}")
    print(f"{args.file}: OK (backend = {', '.join(config.candidates)}, validate = {config.validate})")
    for note in notes:
        print(f"  note: {note}")
    return EXIT_OK


def cmd_run(args) -> int:
    from ..decode import decode_run
    from ..kernel import open_kernel
    from .progress import Progress

    for name in ("layers", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"ssu run: error: --{name} must be at least 1")
    problem = problem_from_args(args)
    kernel = open_kernel(_config(args), problem)
    print(f"ssu run: backend {kernel.backend} ({kernel.distribution}); {problem.describe()}", flush=True)
    bar = Progress(args.steps, "decode")
    try:
        report = decode_run(kernel, layers=args.layers, steps=args.steps, batch=args.batch, seed=args.seed,
                            pad_rows=args.pad_rows, check_every=args.check_every, progress=bar)
    finally:
        bar.close()
    print(report.summary())
    return EXIT_OK if report.ok else EXIT_WRONG


def cmd_verify(args) -> int:
    from ..conformance import run_conformance
    from ..registry import default_registry

    config = _config(args)
    name = config.candidates[0]
    registry = default_registry()
    caps = registry.load(name).spec.capabilities
    device = args.device or _default_device(caps.devices)
    results = run_conformance(name, device=device, registry=registry, options=config.options_for(name))
    failed = [r for r in results if not r.passed]
    print(f"ssu verify: backend {name} on {device}")
    for r in results:
        print(f"  {'PASS' if r.passed else 'FAIL'}  {r.name}  [{r.problem}]")
        if r.detail:
            print(f"        {r.detail}")
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return EXIT_WRONG if failed else EXIT_OK


def cmd_new_backend(args) -> int:
    from ..scaffold import module_name, write_backend

    root = write_backend(args.name, args.dir, force=args.force)
    print(f"wrote {root}/ (backend {args.name!r}, module {module_name(args.name)})")
    print(f"next: pip install -e \"{root}[test]\" && (cd {root} && pytest)")
    return EXIT_OK


COMMANDS = {"new-backend": cmd_new_backend, "backends": cmd_backends, "explain": cmd_explain, "check-config": cmd_check_config,
            "run": cmd_run, "verify": cmd_verify}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except SSUError as exc:
        if os.environ.get("SSU_DEBUG"):
            raise
        print(f"ssu {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
