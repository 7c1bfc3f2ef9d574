"""Experiment (GPU only): what limits the triton step below a plain copy. Times, on one shape
(H=128 P=64 N=128 G=8, inputs bf16), the backend's kernel next to

- ``Copy``: the same kernel without its arithmetic (same grid, slot and cursor indexing, pipeline
  and state stores; ``kernel_variants.py`` writes it): the copy ceiling of its memory structure;
- ``PlainCopy``: a contiguous Triton copy of the same bytes (``bandwidth_ceiling.py``'s kernel),
  in place or into another buffer;
- ``Variant``: the kernel of an earlier commit with one way of loading the inputs changed
  (``kernel_variants.py``);
- ``Edited``: the current kernel with one edit (``kernel_variants.py``: L2 eviction hints);
- ``GluonTile`` / ``GluonLoop`` / ``GluonPipe``: the step in Gluon with explicit layouts
  (``gluon_ssu.py``);
- ``GluonTma``: a persistent Gluon step fed by TMA copies, its states written from registers or
  with TMA stores (``gluon_tma.py``).

Every config that computes is first checked against one program per 8-row single-warp tile of
the backend's kernel (state bit-identical, outputs within bf16 rounding; one pad row), then timed
like ``ssu_bench.py`` (CUDA-graph replays of 40 launches over rotated slot sets, cold L2, median).
Results and their dates: docs/benchmarks.md, sixth and seventh sessions.

    python benchmarks/experiments/kernel_variants.py   # in a git checkout: writes generated/
    PYTHONPATH=core:backends/triton_ssu python benchmarks/experiments/structure_probe.py ceiling inputs
    PYTHONPATH=core:backends/triton_ssu python benchmarks/experiments/structure_probe.py tma tmastore evict smoke
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple, Union

import torch

import ssu
from ssu.dtypes import to_torch
from ssu.inputs import step_inputs
from ssu.slot_state import versions
from ssu.timing import graph_time_us
from ssu_backend_triton.kernel import launch
from ssu_backend_triton.tuning import Schedule

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "generated"), str(HERE.parent)]  # gluon_ssu, variants, bandwidth_ceiling
PEAK_TBPS = 4.26
H, P, N, G = 128, 64, 128, 8


class Kernel(NamedTuple):
    """The backend's kernel."""

    schedule: Schedule


class Copy(NamedTuple):
    """The backend's kernel without arithmetic."""

    schedule: Schedule


class Variant(NamedTuple):
    """``kv_<name>`` of kernel_variants.py."""

    name: str
    schedule: Schedule


class Edited(NamedTuple):
    """The backend's current kernel with one edit (``generated/kc_<name>.py``)."""

    name: str
    schedule: Schedule


class GluonTile(NamedTuple):
    rows: int
    lanes: int
    warps: int
    pdl: int = 1
    math: int = 1
    indirect: int = 1
    prefetch: int = 1


class GluonLoop(NamedTuple):
    rows: int
    lanes: int
    warps: int
    tiles: int
    pdl: int = 1


class GluonPipe(NamedTuple):
    rows: int
    lanes: int
    warps: int
    tiles: int
    stages: int
    pdl: int = 1
    math: int = 1
    maxnreg: int = 0


class GluonTma(NamedTuple):
    """``gluon_tma.launch_tma``'s schedule: item rows, lanes a row, warps, ring stages, programs an SM."""

    rows: int
    lanes: int
    warps: int
    stages: int
    ctas: int
    pdl: int = 1
    math: int = 1
    maxnreg: int = 0
    tma_store: int = 0
    lag: int = 1


class PlainCopy(NamedTuple):
    inplace: int
    pdl: int = 1
    warps: int = 4
    block: int = 2048


Config = Union[Kernel, Copy, Variant, Edited, GluonTile, GluonLoop, GluonPipe, GluonTma, PlainCopy]


def _kernels(*schedules, copy: bool = False) -> list:
    out = []
    for s in schedules:
        out += [Kernel(Schedule(*s))] + ([Copy(Schedule(*s))] if copy else [])
    return out


def _variants(schedules, names=("base", "bf", "bfsf", "bfsfb2d", "bfli", "bfsfb2dli", "bfb2d")) -> list:
    return [Variant(n, Schedule(*s)) for s in schedules for n in names]


_PIPE = (
    _kernels((8, 2, 4, 4, 0, 1), (8, 1, 4, 4, 0, 1))
    + [
        GluonPipe(*c)
        for c in (
            (8, 8, 2, 4, 4),
            (8, 8, 2, 8, 4),
            (8, 16, 2, 4, 4),
            (8, 8, 1, 4, 4),
            (8, 4, 1, 4, 4),
            (16, 4, 2, 4, 4),
            (16, 8, 2, 2, 3),
            (16, 8, 2, 4, 4),
            (8, 8, 2, 4, 3),
            (8, 8, 2, 2, 2),
            (16, 8, 2, 2, 2),
            (8, 4, 1, 8, 4),
            (32, 8, 4, 2, 2),
            (16, 8, 4, 4, 4),
        )
    ]
    + [
        GluonPipe(8, 4, 1, 4, 4, maxnreg=96),
        GluonPipe(16, 4, 2, 4, 4, maxnreg=96),
        GluonPipe(8, 8, 1, 4, 4, maxnreg=80),
        GluonPipe(8, 8, 2, 4, 4, pdl=0),
    ]
    + [GluonLoop(16, 8, 2, 2), GluonLoop(8, 8, 2, 4), GluonLoop(16, 16, 2, 2)]
    + [GluonPipe(8, 8, 2, 4, 4, math=0), GluonPipe(16, 8, 2, 2, 3, math=0), GluonPipe(8, 4, 1, 4, 4, math=0)]
    + [Copy(Schedule(*s)) for s in ((8, 2, 4, 4, 0, 1), (8, 1, 4, 4, 0, 1), (16, 2, 4, 3, 0, 1), (16, 1, 1, 0, 0, 1))]
)
_DEEP = _kernels(
    (8, 2, 4, 4, 0, 1),
    (8, 2, 8, 4, 0, 1),
    (8, 2, 8, 6, 0, 1),
    (8, 2, 8, 8, 0, 1),
    (8, 1, 8, 8, 0, 1),
    (8, 1, 8, 6, 0, 1),
    (16, 2, 4, 4, 0, 1),
    (16, 4, 4, 4, 0, 1),
    (8, 4, 8, 8, 0, 1),
    (4, 2, 16, 8, 0, 1),
    (4, 1, 16, 8, 0, 1),
    (4, 1, 16, 12, 0, 1),
    (8, 2, 4, 3, 0, 1),
    (8, 2, 2, 2, 0, 1),
    (16, 2, 2, 2, 0, 1),
    copy=True,
)
_CEIL1 = (
    _kernels((8, 2, 4, 4, 0, 1))
    + [Copy(Schedule(8, 2, 4, 4, 0, 1)), Copy(Schedule(16, 1, 1, 0, 0, 1))]
    + [
        GluonTile(r, l, w, math=0, indirect=i)
        for r, l, w in ((16, 4, 2), (16, 16, 2), (8, 16, 1), (32, 16, 4))
        for i in (1, 0)
    ]
    + [
        PlainCopy(i, pdl, w, b)
        for pdl, w, b in ((1, 4, 2048), (0, 4, 2048), (1, 2, 1024), (1, 8, 4096))
        for i in (1, 0)
    ]
)
_CEIL4 = (
    _kernels((16, 1, 1, 0, 128, 1))
    + [Copy(Schedule(*s)) for s in ((16, 1, 1, 0, 128, 1), (8, 1, 1, 0, 0, 1), (4, 1, 1, 0, 0, 1))]
    + [
        GluonTile(r, l, w, math=0, indirect=i)
        for r, l, w in ((16, 4, 2), (16, 16, 2), (8, 16, 1), (32, 16, 4), (4, 16, 1))
        for i in (1, 0)
    ]
)
_SPEC4 = _kernels((16, 1, 1, 0, 128, 1), (8, 1, 1, 0, 96, 1)) + [
    GluonTile(*c)
    for c in (
        (16, 8, 2),
        (8, 8, 1),
        (16, 16, 2),
        (8, 16, 1),
        (4, 16, 1),
        (4, 8, 1),
        (8, 4, 1),
        (16, 4, 2),
        (32, 8, 4),
        (32, 16, 4),
        (8, 8, 2),
        (8, 16, 2),
        (2, 16, 1),
        (16, 16, 4),
        (16, 8, 4),
        (4, 16, 2),
    )
]
_GLUON1 = (
    _kernels((8, 2, 4, 4, 0, 1), (8, 1, 1, 0, 0, 1))
    + [
        GluonTile(*c, prefetch=0)
        for c in (
            (16, 4, 2),
            (32, 4, 4),
            (8, 4, 1),
            (16, 8, 2),
            (32, 8, 4),
            (16, 4, 1),
            (32, 4, 2),
            (64, 4, 4),
            (64, 4, 8),
            (32, 8, 2),
            (16, 16, 2),
            (64, 8, 8),
        )
    ]
    + [GluonTile(16, 4, 2, pdl=0, prefetch=0)]
    + [GluonTile(*c, math=0) for c in ((16, 4, 2, 1), (32, 4, 4, 1), (64, 4, 4, 1), (8, 4, 1, 1))]
)
_GLUON4 = (
    _kernels((16, 1, 1, 0, 128, 1), (8, 1, 1, 0, 0, 1))
    + [
        GluonTile(*c, prefetch=0)
        for c in (
            (16, 8, 2),
            (16, 4, 2),
            (8, 4, 1),
            (8, 8, 1),
            (16, 16, 2),
            (32, 8, 4),
            (32, 4, 4),
            (16, 4, 4),
            (16, 8, 4),
        )
    ]
    + [GluonTile(16, 4, 2, math=0)]
)

_TMA1 = (
    _kernels((8, 2, 4, 4, 0, 1, 1))
    + [
        GluonTma(*c)
        for c in (
            (16, 8, 4, 6, 4),
            (16, 8, 4, 4, 5),
            (16, 8, 4, 8, 5),
            (16, 16, 2, 6, 8),
            (32, 8, 4, 4, 4),
            (32, 8, 4, 6, 3),
            (32, 8, 8, 4, 2),
            (32, 8, 8, 6, 2),
            (64, 8, 8, 3, 2),
            (64, 8, 8, 4, 2),
            (64, 8, 4, 3, 2),
        )
    ]
    + [GluonTma(*c, math=0) for c in ((16, 8, 4, 6, 4), (32, 8, 8, 6, 2), (64, 8, 8, 3, 2))]
)
_TMA4 = _kernels((16, 1, 1, 0, 128, 1)) + [
    GluonTma(*c)
    for c in (
        (16, 8, 4, 4, 3),
        (16, 8, 4, 6, 3),
        (16, 8, 4, 4, 4, 1, 1, 128),
        (8, 16, 2, 6, 8),
        (8, 16, 2, 8, 8),
        (16, 16, 2, 4, 5),
        (16, 8, 4, 4, 3, 1, 0),
    )
]

_TMAST = (
    _kernels((8, 2, 4, 4, 0, 1, 1))
    + [
        GluonTma(*c, tma_store=1, lag=lag, math=math)
        for math in (1, 0)
        for c, lag in (
            ((64, 8, 8, 3, 2), 1),
            ((64, 8, 8, 4, 2), 2),
            ((64, 8, 8, 6, 2), 2),
            ((64, 8, 8, 6, 2), 3),
            ((32, 8, 4, 6, 3), 2),
            ((32, 8, 4, 4, 4), 1),
            ((32, 8, 4, 4, 4), 2),
            ((16, 16, 2, 6, 8), 2),
            ((16, 16, 2, 4, 8), 1),
            ((32, 16, 4, 6, 4), 2),
        )
    ]
)


def _edits(schedule, names=("evict_load", "evict_store", "evict_both")) -> list:
    """The kernel with ``schedule``, its edited variants, and the kernel again (the drift of the run)."""
    k = Kernel(Schedule(*schedule))
    return [k] + [Edited(n, Schedule(*schedule)) for n in names] + [k]


#: name -> [(state dtype, tokens, batch, configs)]
CASES = {
    "gluon": [
        ("bf16", 1, 32, _GLUON1),
        ("bf16", 1, 128, _GLUON1),
        (
            "fp32",
            1,
            32,
            _kernels((16, 1, 1, 0, 0, 1))
            + [
                GluonTile(*c, prefetch=0)
                for c in ((8, 4, 1), (16, 4, 2), (16, 8, 1), (16, 8, 2), (32, 8, 2), (32, 4, 4), (32, 8, 4))
            ],
        ),
        ("bf16", 4, 32, _GLUON4),
        ("fp32", 4, 32, _GLUON4),
    ],
    "pipe": [("bf16", 1, 32, _PIPE), ("bf16", 1, 128, _PIPE), ("bf16", 1, 16, _PIPE[:20])],
    "deep": [("bf16", 1, 32, _DEEP), ("bf16", 1, 128, _DEEP)],
    "tmastore": [("bf16", 1, 32, _TMAST), ("bf16", 1, 128, _TMAST)],
    "smoke": [  # one config of each Gluon kernel, checked against the backend's
        (
            "bf16",
            1,
            32,
            [
                GluonTile(16, 4, 2, prefetch=0),
                GluonLoop(8, 8, 2, 4),
                GluonPipe(8, 8, 2, 4, 4),
                GluonTma(64, 8, 8, 4, 2, tma_store=1, lag=2),
            ],
        ),
        ("bf16", 4, 32, [GluonTile(16, 8, 2, prefetch=0), GluonTile(16, 8, 2), GluonTma(16, 8, 4, 4, 3)]),
    ],
    "evict": [
        ("bf16", 1, 32, _edits((8, 2, 4, 4, 0, 1, 1))),
        ("bf16", 1, 128, _edits((8, 2, 4, 4, 0, 1, 1))),
        ("bf16", 4, 32, _edits((16, 1, 1, 0, 128, 1, 0))),
        ("fp32", 1, 32, _edits((16, 1, 1, 0, 128, 1, 0))),
        ("fp32", 4, 32, _edits((8, 1, 1, 0, 96, 1, 1))),
    ],
    "tma": [("bf16", 1, 32, _TMA1), ("bf16", 1, 128, _TMA1), ("bf16", 4, 32, _TMA4), ("fp32", 1, 32, _TMA1[:8])],
    "ceiling": [("bf16", 1, 32, _CEIL1), ("bf16", 1, 128, _CEIL1), ("bf16", 4, 32, _CEIL4), ("fp32", 4, 32, _CEIL4)],
    "spec": [(s, 4, b, _SPEC4) for s in ("bf16", "fp32") for b in (32, 128)],
    "inputs": [
        (
            "bf16",
            1,
            32,
            _variants(
                [(8, 2, 4, 4, 0, 1), (8, 1, 4, 4, 0, 1), (16, 2, 4, 3, 0, 1), (8, 2, 8, 4, 0, 1), (16, 1, 1, 0, 0, 1)]
            ),
        ),
        ("bf16", 4, 32, _variants([(16, 1, 1, 0, 128, 1), (8, 1, 1, 0, 0, 1), (4, 1, 1, 0, 0, 1)])),
        ("fp32", 4, 32, _variants([(8, 1, 1, 0, 96, 1), (4, 1, 1, 0, 0, 1), (8, 1, 1, 0, 0, 1)])),
        ("fp32", 1, 32, _variants([(16, 1, 1, 0, 0, 1), (8, 1, 1, 0, 0, 1), (8, 2, 4, 4, 0, 1)])),
        ("bf16", 1, 128, _variants([(8, 2, 4, 4, 0, 1), (8, 1, 4, 4, 0, 1), (16, 2, 4, 3, 0, 1)])),
        ("fp32", 4, 128, _variants([(8, 1, 1, 0, 96, 1), (4, 1, 1, 0, 0, 1)])),
        ("bf16", 4, 128, _variants([(16, 1, 1, 0, 128, 1), (8, 1, 1, 0, 0, 1)])),
    ],
}


def _generated(name: str):
    try:
        return __import__(name)
    except ImportError as exc:
        raise SystemExit(
            f"{name}.py not found: run benchmarks/experiments/kernel_variants.py in a git checkout "
            f"(it writes benchmarks/experiments/generated/)"
        ) from exc


def run(p: ssu.Problem, cfg: Config, ssm, cursor, slots, i, out):
    """One launch of ``cfg`` on ``ssm``; returns the compiled kernel (for its registers)."""
    args = (ssm, cursor, 0, i.x, i.dt, i.A, i.B, i.C, slots, i.D, i.z, i.dt_bias, i.dt_softplus, out)
    kw = dict(
        pad_slot_id=p.pad_slot_id, heads_per_group=p.heads_per_group, speculative=p.speculative, versions=versions(p)
    )
    if isinstance(cfg, Kernel):
        return launch(*args, None, **kw, **cfg.schedule._asdict())
    if isinstance(cfg, Copy):
        return _generated("kernel_copy").launch(*args, None, **kw, **cfg.schedule._asdict())
    if isinstance(cfg, Variant):
        schedule = cfg.schedule._asdict()
        schedule.pop("branchless")
        return _generated(f"kv_{cfg.name}").launch(*args, None, **kw, **schedule)
    if isinstance(cfg, Edited):
        return _generated(f"kc_{cfg.name}").launch(*args, None, **kw, **cfg.schedule._asdict())
    if isinstance(cfg, GluonTma):
        import gluon_tma

        return gluon_tma.launch_tma(*args, **kw, **cfg._asdict())
    import gluon_ssu

    if isinstance(cfg, GluonTile):
        return gluon_ssu.launch_gluon(*args, **kw, **cfg._asdict())
    if isinstance(cfg, GluonLoop):
        return gluon_ssu.launch_gluon_loop(*args, **kw, **cfg._asdict())
    return gluon_ssu.launch_gluon_pipe(*args, **kw, **cfg._asdict())


def plain_copy_us(cfg: PlainCopy, ssm, batch: int, sets: int) -> float:
    from bandwidth_ceiling import copy_kernel

    views = [ssm[0, k * batch : (k + 1) * batch].reshape(-1) for k in range(sets)]
    dsts = [v if cfg.inplace else torch.empty_like(v) for v in views]
    n = views[0].numel()
    launches = [
        (
            lambda v=v, d=d: copy_kernel[(n // cfg.block,)](
                v,
                d,
                n,
                COPIES=1,
                BLOCK=cfg.block,
                PERSISTENT=False,
                STAGES=0,
                PDL=bool(cfg.pdl),
                num_warps=cfg.warps,
                launch_pdl=bool(cfg.pdl),
            )
        )
        for v, d in zip(views, dsts)
    ]
    return graph_time_us(launches, replays=7, warmup=1, min_launches=max(40, sets))


def computes(cfg: Config) -> bool:
    return not isinstance(cfg, (Copy, PlainCopy)) and getattr(cfg, "math", 1) == 1


def case(state_dtype: str, T: int, batch: int, configs: list) -> None:
    p = ssu.Problem(
        nheads=H,
        headdim=P,
        dstate=N,
        ngroups=G,
        state_dtype=state_dtype,
        input_dtype="bf16",
        num_slots=1,
        max_batch=batch,
        device="cuda",
        tokens_per_step=T,
        speculative=T > 1,
    )
    K = versions(p)
    per_set = p.state_bytes_per_slot() * batch
    sets = max(1, min(16, -(-(512 << 20) // per_set)))
    ssm = torch.randn(1, sets * batch, K, H, P, N, device="cuda").to(to_torch(state_dtype))
    cursor = torch.randint(0, K, (sets * batch,), dtype=torch.int32, device="cuda") if T > 1 else None
    gen = torch.Generator().manual_seed(batch)
    slot_sets = [torch.arange(i * batch, (i + 1) * batch, dtype=torch.int32, device="cuda") for i in range(sets)]
    inputs = [step_inputs(p, s, gen) for s in slot_sets]
    slot_sets[0][min(3, batch - 1)] = p.pad_slot_id  # a pad row in the checked set
    outs = [torch.empty_like(i.x) for i in inputs]
    traffic = per_set * (1 + T)
    pristine = ssm.clone()
    ref_state, ref_out = pristine.clone(), torch.zeros_like(outs[0])
    run(p, Kernel(Schedule(8, 1)), ref_state, cursor, slot_sets[0], inputs[0], ref_out)
    for cfg in configs:
        regs, check = "", "copy"
        try:
            if isinstance(cfg, PlainCopy):
                us = plain_copy_us(cfg, ssm, batch, sets)
            else:
                st, o = pristine.clone(), torch.zeros_like(outs[0])
                compiled = run(p, cfg, st, cursor, slot_sets[0], inputs[0], o)
                regs = f"{getattr(compiled, 'n_regs', '?')}/{getattr(compiled, 'n_spills', '?')}"
                if computes(cfg):
                    same = torch.equal(st, ref_state)
                    close = torch.allclose(o.float(), ref_out.float(), atol=2e-2, rtol=2e-2)
                    check = (
                        "ok"
                        if same and close
                        else (
                            f"MISMATCH state {(st.float() - ref_state.float()).abs().max().item():.3g} "
                            f"out {(o.float() - ref_out.float()).abs().max().item():.3g}"
                        )
                    )
                del st
                launches = [
                    (lambda s=s, i=i, o=o: run(p, cfg, ssm, cursor, s, i, o))
                    for s, i, o in zip(slot_sets, inputs, outs)
                ]
                us = graph_time_us(launches, replays=7, warmup=1, min_launches=max(40, sets))
        except Exception as exc:  # noqa: BLE001  (a rejected config is reported, not fatal)
            print(
                f"| {state_dtype} | {T} | {batch} | {cfg} | failed | | | | {type(exc).__name__}: {str(exc)[:200]} |",
                flush=True,
            )
            continue
        tbps = traffic / us / 1e6
        print(
            f"| {state_dtype} | {T} | {batch} | {cfg} | {us:.1f} | {tbps:.2f} | {100 * tbps / PEAK_TBPS:.0f}% | "
            f"{regs} | {check} |",
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", choices=sorted(CASES))
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton {__import__('triton').__version__}")
    print("| state | T | batch | config | us | TB/s | % of 4.26 | regs/spills | check |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.cases:
        for state_dtype, T, batch, configs in CASES[name]:
            case(state_dtype, T, batch, configs)
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
