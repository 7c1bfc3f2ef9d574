"""A tensor-parallel decode: one process per GPU (torch.distributed, NCCL), each rank opening a
kernel for its shard of a model's SSU layer (``Problem.shard``) on its own device and running the
decode; outputs and final states are gathered to rank 0 and checked against one unsharded kernel
on a single device fed the same inputs and states. Prints each rank's step time (CUDA events,
median) and the agreement.

    python benchmarks/tp_decode.py --tp 2 --model nemotron-h-8b --backend triton
    python benchmarks/tp_decode.py --tp 2 --model granite-4.0-h --backend triton   # G = 1: replicated
    python benchmarks/tp_decode.py --tp 2 --device cpu --backend reference --nheads 8 --headdim 8 \\
        --dstate 16 --ngroups 2                                    # the same on the CPU (gloo)

Every rank draws the same unsharded inputs from one seed and takes its heads and groups
(``Problem.shard_slices``), so nothing but the results crosses between processes. Exit status 0
when every rank's outputs and states agree with the unsharded run within the oracle's budgets.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time

import attrs
import torch
import torch.distributed as dist

import ssu
from ssu.checking import oracle
from ssu.cli.problem_args import MODELS
from ssu.checking.inputs import layer_weights, random_states, step_inputs


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="ranks (one GPU each; default 2)")
    p.add_argument("--model", choices=sorted(MODELS), default="nemotron-h-8b")
    for name in ("nheads", "headdim", "dstate", "ngroups"):
        p.add_argument(f"--{name}", type=int, help=f"override the model's {name}")
    p.add_argument("--backend", default="triton")
    p.add_argument("--device", default="cuda", help="cuda (rank r on cuda:r, NCCL) or cpu (gloo)")
    p.add_argument("--state-dtype", default="fp32")
    p.add_argument("--input-dtype", default="bf16")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help="decode steps checked")
    p.add_argument("--timed", type=int, default=50, help="further steps timed per rank")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def full_problem(args) -> ssu.Problem:
    shape = dict(MODELS[args.model])
    shape.update({k: getattr(args, k) for k in shape if getattr(args, k) is not None})
    return ssu.Problem(
        **shape,
        state_dtype=args.state_dtype,
        input_dtype=args.input_dtype,
        num_slots=2 * args.batch,
        max_batch=args.batch,
        device="cpu",
    )


def draw(problem: ssu.Problem, args):
    """The unsharded states, weights and per-step inputs, on the CPU, from the seed."""
    gen = torch.Generator().manual_seed(args.seed)
    states = random_states(problem, problem.num_slots, gen)
    weights = layer_weights(problem, gen)
    slots = torch.randperm(problem.num_slots, generator=gen)[: args.batch].to(torch.int32)
    steps = [step_inputs(problem, slots, gen, weights=weights).kwargs() for _ in range(args.steps)]
    return states, steps


def take(call: dict, heads: range, groups: range, device: str) -> dict:
    """One rank's part of a step call: its heads of x, z, dt, A, D, dt_bias, its groups of B, C."""
    h = slice(heads.start, heads.stop)
    g = slice(groups.start, groups.stop)
    out = {}
    for name, value in call.items():
        if not isinstance(value, torch.Tensor):
            out[name] = value
            continue
        if name in ("x", "z"):
            value = value[..., h, :]
        elif name == "dt":
            value = value[..., h]
        elif name in ("A", "D", "dt_bias"):
            value = value[h]
        elif name in ("B", "C"):
            value = value[..., g, :]
        out[name] = value.contiguous().to(device)
    return out


def decode(kernel, states, steps, slots_all, timed: int):
    """Write ``states``, run ``steps``; returns (outputs, final states, median step microseconds)."""
    device = kernel.problem.device
    state = kernel.allocate_state(1)
    everything = slots_all.to(device)
    kernel.write_state(state, everything, states.to(device))
    outs = [kernel.step(state, **call, layer=0).cpu() for call in steps]
    final = kernel.read_state(state, everything).cpu()
    times = []
    call = steps[-1]
    if device.startswith("cuda"):
        with torch.cuda.device(device):
            for _ in range(timed):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                kernel.step(state, **call, layer=0)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(timed):
            t0 = time.perf_counter()
            kernel.step(state, **call, layer=0)
            times.append((time.perf_counter() - t0) * 1e6)
    return torch.stack(outs), final, statistics.median(times) if times else float("nan")


def rank_main(rank: int, args, init: str) -> None:
    cuda = args.device.startswith("cuda")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=args.tp)
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    full = full_problem(args)
    problem = full.shard(args.tp, rank, device=device)
    heads, groups = full.shard_slices(args.tp, rank)
    states, steps = draw(full, args)
    mine = [take(call, heads, groups, device) for call in steps]
    kernel = ssu.open(ssu.Config(backend=args.backend), problem)
    kernel.warmup(kernel.allocate_state(1))
    slots_all = torch.arange(full.num_slots, dtype=torch.int32)
    outs, final, us = decode(kernel, states[:, heads.start : heads.stop], mine, slots_all, args.timed)
    results = [None] * args.tp if rank == 0 else None
    dist.gather_object(dict(rank=rank, device=device, outs=outs, final=final, us=us, heads=heads), results, dst=0)
    if rank == 0:
        ok = report(args, full, results, states, steps, slots_all)
        dist.destroy_process_group()
        sys.exit(0 if ok else 1)
    dist.destroy_process_group()


def report(args, full: ssu.Problem, results, states, steps, slots_all) -> bool:
    """Compare the gathered shards with one unsharded kernel on rank 0's device; print the lines."""
    device = results[0]["device"]
    single = ssu.open(ssu.Config(backend=args.backend), attrs.evolve(full, device=device))
    calls = [take(c, range(full.nheads), range(full.ngroups), device) for c in steps]
    want_outs, want_final, single_us = decode(single, states, calls, slots_all, args.timed)
    got_outs = torch.cat([r["outs"] for r in results], dim=-2)
    got_final = torch.cat([r["final"] for r in results], dim=1)
    out_budget, state_budget = oracle.tolerances(full)
    out_err, state_err = oracle.rel_error(got_outs, want_outs), oracle.rel_error(got_final, want_final)
    identical = torch.equal(got_outs, want_outs) and torch.equal(got_final, want_final)
    replicated = " (the single group replicated on every rank)" if full.ngroups == 1 and args.tp > 1 else ""
    print(f"tp_decode: {args.backend}, {full.describe()}, tp={args.tp}{replicated}, {args.steps} steps checked")
    for r in results:
        print(
            f"  rank {r['rank']} on {r['device']}: heads {r['heads'].start}-{r['heads'].stop - 1}, "
            f"step {r['us']:.1f} us"
        )
    print(f"  unsharded on {device}: step {single_us:.1f} us")
    print(
        f"  gathered vs unsharded: outputs {out_err:.2e} (budget {out_budget:.1e}), states {state_err:.2e} "
        f"(budget {state_budget:.1e}){', bit-identical' if identical else ''}"
    )
    ok = out_err <= out_budget and state_err <= state_budget
    print("  OK" if ok else "  MISMATCH")
    return ok


def main(argv=None) -> int:
    args = parse(argv)
    if args.device.startswith("cuda") and torch.cuda.device_count() < args.tp:
        print(f"tp_decode: --tp {args.tp} needs {args.tp} GPUs; {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    try:
        full_problem(args).shard(args.tp, 0)  # a shape that does not split is refused here, with the reason
    except ssu.ConfigError as exc:
        print(f"tp_decode: {exc}", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init = f"tcp://127.0.0.1:{port}"
    try:
        torch.multiprocessing.spawn(rank_main, args=(args, init), nprocs=args.tp, join=True)
    except torch.multiprocessing.ProcessExitedException as exc:
        return exc.exit_code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
