"""``ssu bench --from``: the table, plot and advice of a saved run again, its rows as measured. A
file that is not a saved run is one line saying what it is instead, before anything is written."""

from __future__ import annotations

from pathlib import Path

from .bench_options import check_saved
from .usage import UsageError

#: the remedy of every refused ``--from`` file
GIVE_SAVED = "give the bench.json that ssu bench --out wrote"
#: a saved row's fields that are whole numbers, and their measured times, which are numbers
WHOLE = ("nheads", "headdim", "dstate", "ngroups", "tokens", "batch")


def saved_run(path: str) -> dict:
    """The JSON object a ``--from`` file holds; a file that cannot be read or holds no saved run is
    a usage error in ssu's words (never the JSON parser's)."""
    import json

    try:
        text = Path(path).read_bytes()
    except IsADirectoryError:
        raise UsageError(f"--from {path}: a folder; give the bench.json in it") from None
    except OSError as exc:
        raise UsageError(f"--from {path}: cannot read it ({exc.strerror or 'unreadable'}); {GIVE_SAVED}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--from {path}: not JSON (line {exc.lineno}, column {exc.colno}); {GIVE_SAVED}") from None
    except ValueError:  # bytes that are no text at all
        raise UsageError(f"--from {path}: not a JSON text file; {GIVE_SAVED}") from None
    if isinstance(data, dict) and "cells" in data and "rows" not in data:
        raise UsageError(f"--from {path}: an ssu bench --engine run, which --from does not render; {GIVE_SAVED}")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise UsageError(f"--from {path}: JSON, but not the rows of an ssu bench run; {GIVE_SAVED}")
    return data


def saved_rows(path: str, data: dict) -> list:
    """The measured rows of a saved run, each field checked (a hand-edited file fails here, naming
    the row, not in the table's arithmetic)."""
    return [_saved_row(r, f"--from {path}: row {i} of the saved run") for i, r in enumerate(data["rows"], 1)]


def _saved_row(r, where: str):
    import attrs

    from ..bench import measure
    from ..contract.dtypes import INPUT_DTYPES, STATE_DTYPES, dtype_in
    from ..contract.errors import ConfigError

    def bad(why: str) -> UsageError:
        return UsageError(f"{where} {why}; {GIVE_SAVED}")

    if not isinstance(r, dict):
        raise bad("is not a table")
    missing = [k for k in ("backend", *WHOLE[:4], "us") if k not in r]
    if missing:
        raise bad(f"has no {', '.join(missing)}")
    case = {k: r[k] for k in (f.name for f in attrs.fields(measure.Case)) if k in r}
    if any(not isinstance(case[k], int) or isinstance(case[k], bool) or case[k] < 1 for k in WHOLE if k in case):
        raise bad("has a shape, token count or batch that is not a positive whole number")
    if not isinstance(r["us"], (int, float)) or isinstance(r["us"], bool) or not r["us"] > 0:
        raise bad(f"has no positive time in us ({r['us']!r})")
    traffic = r.get("traffic") or {}
    if not isinstance(traffic, dict) or not all(isinstance(v, (int, float)) for v in traffic.values()):
        raise bad("has traffic that is not bytes by part")
    try:
        for key, valid, kind in (
            ("state_dtype", STATE_DTYPES, "a state cache dtype"),
            ("input_dtype", INPUT_DTYPES, "an input dtype"),
        ):
            case[key] = dtype_in(case.get(key, valid[0]), valid, what=key, kind=kind)
    except ConfigError as exc:
        raise bad(f"has {exc}") from None
    return measure.Row(
        measure.Case(**case), r["us"], r.get("commit_us"), r.get("timing", "graph"), tuple(traffic.items())
    )


def render_saved(args) -> int:
    """``--from``: the table, plot and advice of a saved run (its rows as measured), written to
    ``--out`` when given."""
    from ..bench import report

    check_saved(args)
    data = saved_run(args.saved)
    rows = saved_rows(args.saved, data)
    saved_ceiling = data.get("ceiling_tbps")
    if not (saved_ceiling is None or isinstance(saved_ceiling, (int, float)) and saved_ceiling > 0):
        raise UsageError(
            f"--from {args.saved}: its ceiling_tbps {saved_ceiling!r} is not a positive number; {GIVE_SAVED}"
        )
    refused = data.get("refused") if isinstance(data.get("refused"), dict) else {}
    ceiling = args.ceiling or saved_ceiling
    title = str(data.get("title", "ssu bench")) + (f" (copy ceiling {ceiling:.2f} TB/s)" if args.ceiling else "")
    text = report.table(rows, ceiling, refused)
    spans = report.recommend([r for r in rows if not r.case.backend.endswith("+adopted")])
    advice = report.advice(spans, rows)
    print(title)
    print(text)
    print()
    print(advice)
    if args.out:
        write_out(args.out, title, text, advice, rows, dict(data, title=title, ceiling_tbps=ceiling), refused, spans)
    return 0


def write_out(folder: str, title: str, text: str, advice: str, rows, meta: dict, refused, spans):
    """Write a run's bench.txt, bench.json and (where there are rows and matplotlib) bench.png to
    ``folder``, made if missing; whether the plot was written (None: no row). A folder that
    cannot be written is a :class:`UsageError` naming ``--out``."""
    from ..bench import report

    out = Path(folder)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.txt").write_text(f"{title}\n{text}\n\n{advice}\n")
        report.write_json(out / "bench.json", rows, meta, refused, spans)
        return report.plot(out / "bench.png", rows, meta["title"], meta["ceiling_tbps"]) if rows else None
    except OSError as exc:
        raise UsageError(f"cannot write to --out {folder}: {exc.strerror or exc}") from None
