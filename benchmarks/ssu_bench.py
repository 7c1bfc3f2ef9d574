"""SSU step time per backend, shape, state dtype, tokens and batch on a GPU: CUDA-graph replays,
cold L2 (each launch in the graph uses another slot set), median of replays.

With several tokens per step (speculative) a timed launch is a whole decode step of a one-layer
group: the step and the commit, with realistic acceptance (each draft kept with probability 0.7).
ReplaySSM's slots start at random points of their window (a running server), so that the time is
the amortised one over a long decode; its step with T=1 includes its own cursor commit. The
ReplaySSM backend runs FlashInfer's built-in kernel choice unless ``--options`` asks for tuning.

Reports microseconds per step, the state traffic in TB/s (read once + written once per token; a
pad-free batch), the fraction of 4.26 TB/s (the H200's measured read+write limit) and the ratio
to FlashInfer's selective_state_update when that backend is in the run.

    python benchmarks/ssu_bench.py --backends triton,flashinfer --batches 1,8,32,128 --out results.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import torch

import ssu
from ssu.inputs import layer_weights, step_inputs
from ssu.timing import graph_time_us

PEAK_TBPS = 4.26
SHAPES = {"h128p64n128g8": (128, 64, 128, 8), "h128p80n128g8": (128, 80, 128, 8), "h256p64n256g8": (256, 64, 256, 8)}
#: each timed graph spans at least this many state bytes, so that the L2 (60 MB) stays cold
COLD_BYTES = 1 << 30


def accepted_counts(batch: int, tokens: int, gen, p_accept: float = 0.7):
    """Realistic acceptance: each draft token is kept with probability ``p_accept`` until the first
    rejection, so num_accepted = 1 + the run of kept drafts (1..tokens)."""
    kept = torch.rand(batch, tokens - 1, generator=gen) < p_accept
    return (1 + kept.int().cumprod(1).sum(1)).to(torch.int32).cuda()


def staggered_cursors(state, problem, options, gen) -> None:
    """ReplaySSM: put every slot at a random point of its window (as in a running server, where
    sequences started at different times), so that each step flushes about 1/max_window of them."""
    W = options.get("max_window", 15)
    L = W + problem.tokens_per_step
    S = problem.num_slots
    state.buffers["ring_start"][:S] = torch.randint(0, L, (S,), generator=gen, dtype=torch.int32).cuda()
    state.buffers["pnat"][:S] = torch.randint(0, W + 1, (S,), generator=gen, dtype=torch.int32).cuda()
    state.buffers["dt_cache"].abs_().mul_(0.1)


def measure(backend: str, shape: str, state_dtype: str, tokens: int, batch: int, options: dict, iterations: int):
    """Median microseconds of one decode step of a one-layer group: the step, and for speculative
    problems the commit with realistic acceptance (ReplaySSM's T=1 step commits by itself)."""
    H, P, N, G = SHAPES[shape]
    slot_bytes = H * P * N * {"fp32": 4, "bf16": 2, "fp16": 2}[state_dtype]
    spec = tokens > 1
    K = tokens + 1 if spec else 1
    sets = max(2, min(64, -(-COLD_BYTES // (batch * slot_bytes * K))))
    problem = ssu.Problem(nheads=H, headdim=P, dstate=N, ngroups=G, state_dtype=state_dtype, input_dtype="bf16",
                          num_slots=sets * batch, max_batch=batch, tokens_per_step=tokens, speculative=spec,
                          device="cuda")
    kernel = ssu.open(ssu.Config(backend=backend, validate=False, backends={backend: options} if options else {}),
                      problem)
    state = kernel.allocate_state(num_layers=1)
    gen = torch.Generator().manual_seed(0)
    for name, buf in state.buffers.items():
        if buf.is_floating_point():
            buf.normal_()
    if "pnat" in state.buffers:
        staggered_cursors(state, problem, options, gen)
    weights = layer_weights(problem, gen)
    perm = torch.randperm(problem.num_slots, generator=gen).to(torch.int32).cuda()
    slot_sets = [perm[i * batch:(i + 1) * batch].contiguous() for i in range(sets)]
    inputs = [step_inputs(problem, s, gen, weights=weights).kwargs() for s in slot_sets]
    outs = [torch.empty_like(i["x"]) for i in inputs]
    kernel.warmup(state)
    step = kernel.raw_step
    commit_us = None
    if spec:
        accepted = [accepted_counts(batch, tokens, gen) for _ in range(iterations)]
        launches = [(lambda i=i, o=o, s=s, a=a: (step(state, out=o, layer=0, **i), kernel.commit(state, s, a)))
                    for i, o, s, a in zip(inputs * iterations, outs * iterations, slot_sets * iterations, accepted)]
        commits = [(lambda s=s, a=a: kernel.commit(state, s, a)) for s, a in zip(slot_sets, accepted)]
        us = graph_time_us(launches[:iterations], min_launches=iterations)
        # as many launches per graph as the step's, so the graph's own launch is amortised alike
        commit_us = graph_time_us(commits, min_launches=iterations) if "pnat" not in state.buffers else None
    else:
        launches = [(lambda i=i, o=o: step(state, out=o, layer=0, **i)) for i, o in zip(inputs, outs)]
        us = graph_time_us(launches, min_launches=iterations)
    return us, batch * slot_bytes * (1 + tokens), commit_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="triton")
    parser.add_argument("--shapes", default="h128p64n128g8")
    parser.add_argument("--state-dtypes", default="fp32,bf16")
    parser.add_argument("--tokens", default="1")
    parser.add_argument("--batches", default="1,8,32,128,256,512,1024")
    parser.add_argument("--iterations", type=int, default=40, help="launches per captured graph")
    parser.add_argument("--options", default="{}", help='JSON: {"backend": {option: value}}')
    parser.add_argument("--out", help="also write the table (markdown) and raw rows (JSON) here")
    args = parser.parse_args()
    # ReplaySSM: FlashInfer's one-kernel path, measured faster than its built-in choice on the H200
    # (docs/benchmarks.md); autotuning at every benchmarked batch would take minutes per row
    options = {"flashinfer-replayssm": {"autotune": False, "algorithm": "monolith"}}
    options.update(json.loads(args.options))
    backends = args.backends.split(",")
    rows = []
    head = (f"# ssu_bench {datetime.date.today()} on {torch.cuda.get_device_name()}: torch {torch.__version__}, "
            f"triton {_version('triton')}, flashinfer {_version('flashinfer')}, Python {platform.python_version()}; "
            f"CUDA-graph replays of {args.iterations} launches, cold L2, median of 7")
    print(head, flush=True)
    for shape in args.shapes.split(","):
        for state_dtype in args.state_dtypes.split(","):
            for tokens in (int(t) for t in args.tokens.split(",")):
                for batch in (int(b) for b in args.batches.split(",")):
                    for backend in backends:
                        t0 = time.perf_counter()
                        try:
                            us, moved, commit_us = measure(backend, shape, state_dtype, tokens, batch,
                                                           options.get(backend, {}), args.iterations)
                            torch.cuda.empty_cache()  # the state of this measurement is gone
                        except ssu.SSUError as exc:
                            print(f"{backend} {shape} {state_dtype} T={tokens} b={batch}: skipped: {exc}", flush=True)
                            continue
                        row = dict(backend=backend, shape=shape, state=state_dtype, T=tokens, batch=batch,
                                   us=round(us, 2), tbps=round(moved / us / 1e6, 3),
                                   commit_us=None if commit_us is None else round(commit_us, 2))
                        rows.append(row)
                        print(f"{backend:12s} {shape} {state_dtype} T={tokens} b={batch:5d} {us:9.1f} us "
                              f"{row['tbps']:.2f} TB/s ({row['tbps'] / PEAK_TBPS:.0%} of peak)"
                              f"{'' if commit_us is None else f', commit {commit_us:.1f} us'}"
                              f"  [{time.perf_counter() - t0:.0f} s]", flush=True)
    table = render(rows, backends, head)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
        with open(args.out.rsplit(".", 1)[0] + ".json", "w") as f:
            json.dump(rows, f, indent=1)


def render(rows, backends, head) -> str:
    """Markdown table: per backend us and TB/s, then FlashInfer's time over each other backend's
    (above 1: that backend is faster)."""
    others = [b for b in backends if b != "flashinfer"] if "flashinfer" in backends else []
    lines = [head, "", "| shape | state | T | batch | " + " | ".join(f"{b} us | {b} TB/s" for b in backends)
             + "".join(f" | flashinfer / {b}" for b in others) + " |",
             "|" + "---|" * (4 + 2 * len(backends) + len(others))]
    keys = sorted({(r["shape"], r["state"], r["T"], r["batch"]) for r in rows},
                  key=lambda k: (k[0], k[1], k[2], k[3]))
    for key in keys:
        by = {r["backend"]: r for r in rows if (r["shape"], r["state"], r["T"], r["batch"]) == key}
        cells = []
        for b in backends:
            r = by.get(b)
            cells += [f"{r['us']:.1f}", f"{r['tbps']:.2f} ({r['tbps'] / PEAK_TBPS:.0%})"] if r else ["-", "-"]
        fi = by.get("flashinfer")
        cells += [f"{fi['us'] / by[b]['us']:.2f}x" if fi and b in by else "-" for b in others]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {key[3]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _version(module: str) -> str:
    try:
        return __import__(module).__version__
    except Exception:
        return "absent"


if __name__ == "__main__":
    sys.exit(main())
