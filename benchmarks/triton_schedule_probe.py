"""Sweep the triton kernel's launch schedules on one shape and print time and bandwidth per config.

A development tool (GPU only) for choosing which schedules the warmup's tuner should consider:
tile sizes, warps, tiles per program with their shared-memory pipeline stages, register caps
(``maxnreg``), programmatic dependent launch (``pdl``) and branch-free input loads
(``branchless``). Each config is first checked against one program per 8-row single-warp tile on
one slot set (state bit-identical, outputs within bf16 rounding), then timed with CUDA-graph
replays over rotated slot sets (cold L2), the median. The last column gives
registers, spills and shared memory of the compiled kernel and whether it uses cp.async.

    python benchmarks/triton_schedule_probe.py --state-dtypes bf16,fp32 --batches 32,128,1024
    python benchmarks/triton_schedule_probe.py --configs 8,1,1,0,0 8,1,1,0,96,1,1 --tokens 4
    python benchmarks/triton_schedule_probe.py --configs 8,2,4,4 --without z,D   # what the gate costs
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

import ssu
from ssu.dtypes import to_torch
from ssu.inputs import step_inputs
from ssu.slot_state import versions
from ssu.timing import graph_time_us
from ssu_backend_triton.kernel import launch
from ssu_backend_triton.tuning import Schedule

PEAK_TBS = 4.26
COLD_BYTES = 512 << 20


#: one program per 8-row single-warp tile: what every other schedule is checked against
REFERENCE_CONFIG = Schedule(8, 1)


def configs(quick: bool) -> list[Schedule]:
    """The default sweep: one program per tile, and programs looping over pipelined tiles."""
    tile = ((8, 1), (16, 1), (16, 2), (32, 4)) if quick else ((4, 1), (8, 1), (16, 1), (8, 2), (16, 2), (32, 4))
    looped = ((8, 2, 8, 4), (16, 2, 4, 3)) if quick else (
        (8, 1, 8, 4), (8, 2, 8, 3), (8, 2, 8, 4), (8, 2, 8, 5), (8, 2, 4, 3), (8, 2, 4, 4), (16, 2, 4, 3),
        (16, 2, 4, 4), (16, 4, 4, 3), (16, 4, 4, 4), (4, 2, 16, 4), (4, 2, 16, 6), (32, 4, 2, 2))
    return [Schedule(*c) for c in tile + looped]


def run(p: ssu.Problem, config: Schedule, ssm, cursor, slots, inputs, out):
    return launch(ssm, cursor, 0, inputs.x, inputs.dt, inputs.A, inputs.B, inputs.C, slots, inputs.D, inputs.z,
                  inputs.dt_bias, inputs.dt_softplus, out, None, pad_slot_id=p.pad_slot_id,
                  heads_per_group=p.heads_per_group, speculative=p.speculative, versions=versions(p),
                  **config._asdict())


def report_code(compiled) -> str:
    """Registers, spills, shared memory and which copy instructions the compiled kernel uses."""
    try:
        ptx = compiled.asm.get("ptx", "")
        return (f"regs {compiled.n_regs} spills {compiled.n_spills} smem {compiled.metadata.shared} "
                f"cp.async {'cp.async.cg' in ptx or 'cp.async.ca' in ptx} "
                f"v4 loads {ptx.count('ld.global.v4')}")
    except Exception as exc:  # noqa: BLE001
        return f"({type(exc).__name__})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--state-dtypes", default="bf16,fp32")
    ap.add_argument("--batches", default="32,128,1024")
    ap.add_argument("--shape", default="128,64,128,8", help="H,P,N,G")
    ap.add_argument("--quick", action="store_true", help="fewer configs")
    ap.add_argument("--configs", nargs="*", help="explicit configs: block_p,warps,tiles,stages,maxnreg,pdl,branchless")
    ap.add_argument("--tokens", type=int, default=1, help="T (above 1: speculative, T + 1 state versions)")
    ap.add_argument("--without", default="", help="inputs to leave out, e.g. z,D (what the per-row work costs)")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop sweeping after this many seconds")
    args = ap.parse_args()
    H, P, N, G = (int(v) for v in args.shape.split(","))
    t_start = time.time()
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{__import__('triton').__version__}; H={H} P={P} N={N} G={G}, inputs bf16, T={args.tokens}"
          f"{', without ' + args.without if args.without else ''}", flush=True)
    columns = ["state", "batch", *Schedule._fields, "us", "TB/s", "% of 4.26", "code"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    sweep = ([Schedule(*(int(v) for v in c.split(","))) for c in args.configs] if args.configs
             else configs(args.quick))
    T = args.tokens
    for state_dtype, batch in itertools.product(args.state_dtypes.split(","), (int(b) for b in args.batches.split(","))):
        p = ssu.Problem(nheads=H, headdim=P, dstate=N, ngroups=G, state_dtype=state_dtype, input_dtype="bf16",
                        num_slots=1, max_batch=batch, device="cuda", tokens_per_step=T, speculative=T > 1)
        K = versions(p)
        per_set = p.state_bytes_per_slot() * batch
        sets = max(1, min(16, -(-COLD_BYTES // per_set)))
        ssm = torch.randn(1, sets * batch, K, H, P, N, device="cuda").to(to_torch(state_dtype))
        cursor = torch.zeros(sets * batch, dtype=torch.int32, device="cuda") if T > 1 else None
        gen = torch.Generator().manual_seed(batch)
        slot_sets = [torch.arange(i * batch, (i + 1) * batch, dtype=torch.int32, device="cuda") for i in range(sets)]
        inputs = [step_inputs(p, s, gen) for s in slot_sets]
        for name in filter(None, args.without.split(",")):
            for i in inputs:
                setattr(i, name, None)
        outs = [torch.empty_like(i.x) for i in inputs]
        traffic = per_set * (1 + T)
        # the check: every config against REFERENCE_CONFIG, both from slot set 0's pristine states
        pristine = ssm[:, :batch].clone()
        ref_state, ref_out = pristine.clone(), torch.empty_like(outs[0])
        run(p, REFERENCE_CONFIG, ref_state, cursor, slot_sets[0], inputs[0], ref_out)
        for config in sweep:
            if time.time() - t_start > args.budget_s:
                print(f"# budget of {args.budget_s} s reached", flush=True)
                return 0
            try:
                check_state, check_out = pristine.clone(), torch.empty_like(outs[0])
                compiled = run(p, config, check_state, cursor, slot_sets[0], inputs[0], check_out)
                ok = torch.equal(check_state, ref_state) and torch.allclose(check_out.float(), ref_out.float(),
                                                                           atol=2e-2, rtol=2e-2)
                mismatch = "" if ok else (
                    f" MISMATCH (state max diff {(check_state.float() - ref_state.float()).abs().max().item():.3g},"
                    f" out {(check_out.float() - ref_out.float()).abs().max().item():.3g})")
                del check_state
                launches = [(lambda s=s, i=i, o=o: run(p, config, ssm, cursor, s, i, o)) for s, i, o in
                            zip(slot_sets, inputs, outs)]
                us = graph_time_us(launches, replays=5, warmup=1, min_launches=max(8, sets))
            except Exception as exc:  # noqa: BLE001  (a rejected config is reported, not fatal)
                print(f"| {state_dtype} | {batch} | {' | '.join(map(str, config))} | failed | | | "
                      f"{type(exc).__name__}: {str(exc)[:160]} |", flush=True)
                continue
            tbs = traffic / us / 1e6
            print(f"| {state_dtype} | {batch} | {' | '.join(map(str, config))} | {us:.1f} | {tbs:.2f} | "
                  f"{100 * tbs / PEAK_TBS:.0f}% | {report_code(compiled)}{mismatch} |", flush=True)
        del ssm, pristine, ref_state
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
