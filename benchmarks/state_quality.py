"""What each state dtype does to a trained model's answers: the recall model of tests/models
decoding through ssu at fp32, bf16, int8 and fp8_e4m3 states (ssu.quality.study), printed as the
tables of docs/quality.md.

    python benchmarks/state_quality.py [--backend reference] [--device cpu] [--n 32]
        [--gaps 1000,4000] [--drift 1000,4000,16000] [--dtypes fp32,bf16,int8,fp8_e4m3]

About 15 minutes on 2 CPU cores with the defaults (the drift's 16000 steps take most of it).

``--rounding stochastic`` is an experiment, not a state dtype ssu serves: the reference backend's
8-bit rows are rounded stochastically (``floor(h / scale + u)``, u uniform in [0, 1), seeded)
instead of to nearest, to compare the two on the same figures.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import ssu
from ssu.quality.model import Mamba2LM
from ssu.quality.study import long_run, recitals

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKPOINT = os.path.join(ROOT, "tests", "models", "mamba2-recall")


def round_stochastically(seed: int = 0) -> None:
    """Make the reference backend round int8 rows stochastically (this process only)."""
    from ssu.contract.dtypes import QMAX
    from ssu.state import quant

    draws = torch.Generator().manual_seed(seed)
    nearest = quant.quantize

    def quantize(values, state_dtype: str):
        if state_dtype != "int8":
            return nearest(values, state_dtype)
        values = values.float()
        scale = values.abs().amax(dim=-1) / QMAX["int8"]
        scaled = values / torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
        noise = torch.rand(scaled.shape, generator=draws).to(scaled.device)
        return torch.floor(scaled + noise).clamp_(-127, 127).to(torch.int8), scale

    quant.quantize = quantize


def _ints(text: str) -> list:
    return [int(v) for v in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=CHECKPOINT)
    p.add_argument("--backend", default="reference")
    p.add_argument("--device", default="cpu")
    p.add_argument("--n", type=int, default=32, help="sequences of the recital figures (default 32)")
    p.add_argument("--drift-n", type=int, default=8, help="sequences of the drift figures (default 8)")
    p.add_argument("--gaps", type=_ints, default=[1000, 4000])
    p.add_argument("--drift", type=_ints, default=[1000, 4000, 16000], help="decode steps (default 1000,4000,16000)")
    p.add_argument("--dtypes", default="fp32,bf16,int8,fp8_e4m3")
    p.add_argument("--rounding", choices=("nearest", "stochastic"), default="nearest", help="int8 rows' rounding")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.rounding == "stochastic":
        if args.backend != "reference":
            p.error("--rounding stochastic changes the reference backend's rounding: use --backend reference")
        round_stochastically()
    lm = Mamba2LM.load(args.checkpoint, device=args.device)
    config = ssu.Config(backend=args.backend)
    dtypes = args.dtypes.split(",")
    began = time.time()
    shapes = f"H={lm.nheads} P={lm.headdim} N={lm.dstate} G={lm.ngroups}, {lm.num_layers} layers"
    where = f"backend {args.backend} on {args.device}, torch {torch.__version__}, int8 rounded {args.rounding}"
    print(f"model {os.path.relpath(args.checkpoint, ROOT)}: {shapes}; {where}")
    print()
    print("| prefill | gap | state | accuracy | tokens as fp32 | recitals as fp32 |")
    print("|---|---:|---|---:|---:|---:|")
    for prefill in ("once", "steps"):
        for r in recitals(lm, config, dtypes, args.gaps, n=args.n, prefill=prefill, device=args.device):
            print(f"| {r.prefill} | {r.gap} | {r.state_dtype} | {r.accuracy:.1%} | {r.agreement:.1%} | "
                  f"{r.same_recitals:.1%} |", flush=True)  # fmt: skip
    print(f"\n({time.time() - began:.0f} s)\n")
    print("| state | steps | state error, median | largest | greedy tokens as fp32 |")
    print("|---|---:|---:|---:|---:|")
    run = long_run(lm, config, dtypes, checkpoints=args.drift, n=args.drift_n, device=args.device)
    for r in run.drift:
        print(f"| {r.state_dtype} | {r.steps} | {r.median_error:.2e} | {r.max_error:.2e} | {r.token_agreement:.2%} |",
              flush=True)  # fmt: skip
    print()
    print(f"after {max(args.drift)} decode steps (gap {run.recitals[0].gap}):")
    print()
    print("| state | accuracy | tokens as fp32 | recitals as fp32 |")
    print("|---|---:|---:|---:|")
    for r in run.recitals:
        print(f"| {r.state_dtype} | {r.accuracy:.1%} | {r.agreement:.1%} | {r.same_recitals:.1%} |")
    print(f"\n({time.time() - began:.0f} s)")


if __name__ == "__main__":
    main()
