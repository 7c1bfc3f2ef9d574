"""What ``ssu bench`` shows: a table, raw rows as JSON, a plot (with matplotlib), and which backend
to configure for which batches, with a ready ``ssu.toml`` snippet."""

from __future__ import annotations

import json
from typing import Iterable, Optional

import attrs

from .measure import Row

#: a backend within this fraction of the fastest at a batch counts as tied with it there
TIE = 0.03


def _key(row: Row) -> tuple:
    c = row.case
    return (c.state_dtype, c.tokens, c.batch)


#: what a smoke run says instead of a recommendation
SMOKE_ADVICE = (
    "a smoke run recommends no backend (its times are the host's, not the kernels'): run ssu bench on the GPU "
    "you serve from"
)


#: the table's columns; the first :data:`NAMED` hold names and align left, the others numbers, right
COLUMNS = ("backend", "state", "T", "batch", "us/step", "TB/s", "of copy", "floor us", "of floor", "vs fastest")
NAMED = 2


def _line(cells: Iterable[str], widths: list[int]) -> str:
    """One line of the table: each cell padded to its column's width, two spaces between columns
    (a column name of two words stays apart from its neighbours)."""
    return "  ".join(
        cell.ljust(width) if i < NAMED else cell.rjust(width) for i, (cell, width) in enumerate(zip(cells, widths))
    ).rstrip()


def table(rows: list[Row], ceiling_tbps: Optional[float], refused: dict, smoke: bool = False) -> str:
    """One line per measured case: time, bandwidth, fraction of the copy ceiling, the traffic
    floor (the bytes the backend's step must move, at the copy ceiling) and the fraction of it the
    step reaches, and how much slower than the fastest backend of that state dtype, tokens and
    batch. A ``smoke`` run (wall-clock times on the CPU) shows times only: no bandwidth, no ranking.
    Each column is as wide as its widest cell, its name included."""
    best = {}
    for r in rows:
        best[_key(r)] = min(best.get(_key(r), r.us), r.us)
    cells = [COLUMNS]
    for r in sorted(rows, key=lambda r: (_key(r), r.us)):
        c = r.case
        of_copy = f"{r.tbps / ceiling_tbps:.0%}" if ceiling_tbps else "-"
        ratio = r.us / best[_key(r)]
        floor = r.floor_us(ceiling_tbps)
        floor_us, of_floor = ("-", "-") if floor is None else (f"{floor:.1f}", f"{floor / r.us:.0%}")
        tbps = "-" if smoke else f"{r.tbps:.2f}"
        versus = "-" if smoke else ("fastest" if ratio == 1 else f"{ratio:.2f}x")
        numbers = (str(c.tokens), str(c.batch), f"{r.us:.1f}", tbps, of_copy, floor_us, of_floor, versus)
        cells.append((c.backend, c.state_dtype, *numbers))
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = [_line(row, widths) for row in cells]
    if not smoke:
        lines += state_speedups(rows)
    eager = sorted({r.case.backend for r in rows if r.timing == "eager"})
    if eager:
        lines.append(
            f"timed eagerly between CUDA events, host launch time included (no CUDA-graph capture): {', '.join(eager)}"
        )
    for name, reason in refused.items():
        lines.append(f"{name.ljust(widths[0])}  not measured: {reason}")
    return "\n".join(lines)


#: the state dtype every other one is compared with (each backend against its own)
BASE_STATE = "bf16"


def state_speedups(rows: list[Row], base: str = BASE_STATE) -> list[str]:
    """Lines, one per backend, state dtype and token count measured beside ``base`` at the same
    batches: how many times faster than the backend's own ``base`` state each batch runs (what a
    smaller or larger state buys; adopted and allocated caches apart). Empty without such pairs."""
    own = {
        (r.case.backend, r.case.adopt, r.case.tokens, r.case.batch): r.us for r in rows if r.case.state_dtype == base
    }
    found: dict = {}
    for r in sorted(rows, key=lambda r: r.case.batch):
        c = r.case
        ref = own.get((c.backend, c.adopt, c.tokens, c.batch))
        if c.state_dtype != base and ref is not None:
            found.setdefault((c.backend, c.adopt, c.state_dtype, c.tokens), []).append(f"{c.batch} {ref / r.us:.2f}x")
    lines = []
    for (backend, adopt, state, tokens), cells in sorted(found.items()):
        name = f"{backend}{' (adopted cache)' if adopt else ''}"
        lines.append(f"{name}: state {state} against {base}, T={tokens}, speedup by batch: {', '.join(cells)}")
    return lines


@attrs.frozen
class Span:
    """Batches ``low`` to ``high`` (as measured) where ``backend`` is fastest (``tied``: others
    within 3 % of it there)."""

    state_dtype: str
    tokens: int
    low: int
    high: int
    backend: str
    tied: tuple = ()


def recommend(rows: list[Row]) -> list[Span]:
    """For each state dtype and token count, the fastest backend per batch, runs of batches with
    the same winner merged; a batch where another backend is within :data:`TIE` keeps the winner of
    the batch before it when that one is among the tied (so ties do not fragment the ranges)."""
    spans: list[Span] = []
    groups = sorted({(r.case.state_dtype, r.case.tokens) for r in rows})
    for state, tokens in groups:
        by_batch: dict = {}
        for r in rows:
            if (r.case.state_dtype, r.case.tokens) == (state, tokens):
                by_batch.setdefault(r.case.batch, []).append(r)
        previous = None
        for batch in sorted(by_batch):
            ranked = sorted(by_batch[batch], key=lambda r: r.us)
            fastest = ranked[0]
            tied = tuple(r.case.backend for r in ranked[1:] if r.us <= fastest.us * (1 + TIE))
            winner = fastest.case.backend
            if previous is not None and previous.backend in tied:
                winner = previous.backend
                tied = tuple(sorted((set(tied) - {winner}) | {fastest.case.backend}))
            if previous is not None and previous.backend == winner:
                previous = attrs.evolve(previous, high=batch, tied=tuple(sorted(set(previous.tied) | set(tied))))
                spans[-1] = previous
            else:
                previous = Span(state, tokens, batch, batch, winner, tied)
                spans.append(previous)
    return spans


def advice(spans: list[Span], rows: list[Row]) -> str:
    """The recommendation in words and a ready ``ssu.toml``: the backend fastest over most of the
    measured batches first (a config names one backend per engine), the others as fallbacks."""
    if not spans:
        return "nothing measured: no backend to recommend"
    lines = []
    for s in spans:
        batches = f"batch {s.low}" if s.low == s.high else f"batches {s.low} to {s.high}"
        also = f" (within {TIE:.0%}: {', '.join(s.tied)})" if s.tied else ""
        lines.append(f"state {s.state_dtype}, T={s.tokens}, {batches}: {s.backend}{also}")
    wins: dict = {}
    for s in spans:
        wins[s.backend] = wins.get(s.backend, 0) + sum(
            1
            for r in rows
            if r.case.backend == s.backend
            and (r.case.state_dtype, r.case.tokens) == (s.state_dtype, s.tokens)
            and s.low <= r.case.batch <= s.high
        )
    order = sorted(wins, key=lambda b: -wins[b])
    fallbacks = [b for b in order[1:]] + (["reference"] if "reference" not in order else [])
    snippet = "[ssu]\n" + f"backend = {json.dumps([order[0], *fallbacks])}"
    if len(order) > 1:
        lines.append(
            f"no one backend is fastest at every batch: name the one for the batches you serve; "
            f"{order[0]} wins the most measured batches"
        )
    return "\n".join(lines) + "\n\nssu.toml:\n" + snippet


def write_json(path, rows: list[Row], meta: dict, refused: dict, spans: list[Span]) -> None:
    """Write the rows, the run's metadata, the refusals and the recommended spans as one JSON document."""
    with open(path, "w") as f:
        json.dump(
            dict(
                meta, rows=[r.to_dict() for r in rows], refused=refused, recommendation=[attrs.asdict(s) for s in spans]
            ),
            f,
            indent=1,
        )


def plot(path, rows: list[Row], title: str, ceiling_tbps: Optional[float]) -> bool:
    """Time per step and bandwidth against batch (log axis), a line per backend, a panel pair per
    state dtype and token count. False when matplotlib is missing (nothing written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    groups = sorted({(r.case.state_dtype, r.case.tokens) for r in rows})
    fig, axes = plt.subplots(len(groups), 2, figsize=(10, 3.4 * len(groups)), squeeze=False)
    for (state, tokens), (left, right) in zip(groups, axes):
        for backend in sorted({r.case.backend for r in rows}):
            mine = sorted(
                (r for r in rows if (r.case.backend, r.case.state_dtype, r.case.tokens) == (backend, state, tokens)),
                key=lambda r: r.case.batch,
            )
            if mine:
                batches = [r.case.batch for r in mine]
                left.plot(batches, [r.us for r in mine], marker="o", label=backend)
                right.plot(batches, [r.tbps for r in mine], marker="o", label=backend)
        for ax, what in ((left, "us per step"), (right, "TB/s (state read + written)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch")
            ax.set_ylabel(what)
            ax.set_title(f"state {state}, T={tokens}", fontsize=10)
            ax.grid(True, alpha=0.3)
        left.set_yscale("log")
        if ceiling_tbps:
            right.axhline(ceiling_tbps, color="gray", linestyle="--", linewidth=1, label="copy ceiling")
        right.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def parse_batches(text: str) -> list[int]:
    """``1,8,32`` -> [1, 8, 32] (positive, distinct, sorted); ValueError otherwise."""
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if not values or values[0] < 1:
        raise ValueError(text)
    return values


def names(text: Optional[str], available: Iterable[str]) -> list[str]:
    """``a,b`` or ``all`` (every available backend)."""
    if text is None or text == "all":
        return list(available)
    return [n.strip() for n in text.split(",") if n.strip()]
