"""Where a ``triton-replay`` step spends its time: one launch timed with every slot's cursors held at
a chosen point of its window, so that no row flushes ("ring"), every row flushes ("flush"), one
row in W + 1 flushes ("mixed", a running server's steady state), or the window is 0 and every row
writes its checkpoint ("write"). Prints microseconds and the bandwidth of each regime's own bytes.

    python benchmarks/replay_probe.py --state-dtype fp32,bf16 --batches 128,1024 \
        --plans 8:1:8:4,8:1:8:4:16

``--tokens`` above 1 times a speculative step instead (the regimes as :func:`regime_cursors` sets
them). A plan's fifth number is the fold kernel's heads per program (0 or absent: rows fold inside
the step kernel), its sixth 1 for stepwise outputs (a speculative step in the "write" regime).
``--no-gram`` also times each plan without the gram kernel's launch (the step then reads stale
B . C products: its outputs are wrong, its time a bound on what that launch costs).
``--fold-shapes`` times the fold kernel in other shapes (rows:warps:pipeline stages:beside, the
last 1 when the step kernel runs beside it, 0 when it waits for it). ``--kernels`` names modules
that define ``replay_kernel`` with the shipped kernel's signature (the shipped one by default), so
that kernel variants are compared in one run. CUDA-graph replays, cold
L2 (slot sets rotated), the median; the copy that resets the cursors before each launch is timed
on its own and subtracted.
"""

from __future__ import annotations

import argparse
import importlib

#: the H200's measured read+write limit, bytes per second
CEILING = 4.26e12
REGIMES = ("ring", "mixed", "flush", "write")


def regime_cursors(regime: str, shape, window: int, tokens: int, gen):
    """(start, count) of every slot before the timed launch. With several tokens a step is
    speculative: "ring" leaves room for its tokens, "flush" folds a full ring, and "write" (window
    0) folds the one to ``tokens`` tokens the previous step accepted."""
    import torch

    ring = window + tokens
    start = torch.randint(0, ring, shape, generator=gen, dtype=torch.int32)
    if regime == "ring":
        count = torch.randint(0, window - tokens + 1, shape, generator=gen, dtype=torch.int32)
    elif regime == "mixed":
        count = torch.randint(0, window + 1, shape, generator=gen, dtype=torch.int32)
    elif regime == "flush":
        count = torch.full(shape, window, dtype=torch.int32)
    elif tokens > 1:
        count = torch.randint(1, tokens + 1, shape, generator=gen, dtype=torch.int32)
    else:
        count = torch.zeros(shape, dtype=torch.int32)
        start.zero_()
    return start, count


def regime_bytes(problem, batch: int, regime: str, window: int, counts) -> float:
    """Bytes a launch must move in ``regime``: the checkpoints read, those written, ring rows read
    and appended, inputs and outputs."""
    from ssu.measure.traffic import io_bytes
    from ssu_backend_triton.replay.layout import token_bytes

    p = problem
    tokens = p.tokens_per_step
    ck = p.state_bytes_per_slot()
    ring_row = token_bytes(p)
    mean_k = float(counts.float().mean())
    if tokens > 1:  # speculative: a row with tokens in its ring folds them when the new ones do not fit
        flushing = float(((counts > 0) & (counts + tokens > (0 if regime == "write" else window))).float().mean())
        appended = tokens
    else:
        flushing = {"ring": 0.0, "flush": 1.0, "write": 1.0}.get(regime, float((counts >= window).float().mean()))
        appended = 1 - flushing
    return batch * (ck * (1 + flushing) + ring_row * (mean_k + appended)) + io_bytes(p, batch)


def probe(kernel_module: str, problem, batch: int, plan, regime: str, window: int, gram: bool = True) -> tuple:
    """(microseconds, bytes) of one launch of ``plan`` in ``regime``; without ``gram`` the gram
    kernel is not launched (the step reads stale products: a bound on what its launch costs, the
    outputs wrong)."""
    import torch

    from ssu.checking.inputs import step_inputs
    from ssu.measure.timing import graph_time_us
    from ssu_backend_triton.replay import engine as replay_engine
    from ssu_backend_triton.replay import launch as replay_launch
    from ssu_backend_triton.replay import layout as replay_layout
    from ssu_backend_triton.replay.launch import Plan, ReplayConstants

    replay_launch.replay_kernel = importlib.import_module(kernel_module).replay_kernel
    global _KERNEL_CALL
    if _KERNEL_CALL is None:
        _KERNEL_CALL = replay_launch.kernel_call
    replay_launch.kernel_call = _KERNEL_CALL if gram else _without_gram
    T = problem.tokens_per_step
    ring = window + T
    slot_bytes = problem.state_bytes_per_slot() + replay_layout.ring_bytes_per_slot(problem, ring)
    sets = max(1, min(16, -(-(256 << 20) // (slot_bytes * batch))))
    scratch = replay_engine._scratch_problem(problem, sets * batch, batch)
    state = replay_layout.allocate(scratch, 1, ring, "probe")
    gen = torch.Generator().manual_seed(batch)

    class _Options:
        max_window = window

    replay_engine.randomize(state, _Options, gen)
    start, count = regime_cursors(regime, state.views[0].start.shape, window, T, gen)
    start, count = start.to(problem.device), count.to(problem.device)
    views = state.views[0]
    consts = ReplayConstants(-1, sets * batch, problem.heads_per_group, T > 1, ring, False, 10)
    plan = Plan(*plan[:4], 0 if regime == "write" else window, 1, *plan[4:])
    record = torch.zeros(1, dtype=torch.int64, device=problem.device)
    slot_sets = [
        torch.arange(i * batch, (i + 1) * batch, dtype=torch.int32, device=problem.device) for i in range(sets)
    ]
    inputs = [step_inputs(problem, s, gen) for s in slot_sets]
    outs = [torch.empty_like(i.x) for i in inputs]

    def reset():
        views.start.copy_(start)
        views.count.copy_(count)

    def step(s, i, o):
        reset()
        replay_launch.launch(
            views, i.x, i.dt, i.A, i.B, i.C, s, i.D, i.z, i.dt_bias, i.dt_softplus, o, None, None, record, consts, plan
        )

    launches = [lambda s=s, i=i, o=o: step(s, i, o) for s, i, o in zip(slot_sets, inputs, outs)]
    us = graph_time_us(launches, replays=7, warmup=1, min_launches=32)
    us_reset = graph_time_us([reset], replays=7, warmup=1, min_launches=32)
    if int(record.item()) != 0:
        raise RuntimeError("the probe's rows were refused")
    return us - us_reset, regime_bytes(problem, batch, regime, window, count)


_KERNEL_CALL = None  # replay_launch's own kernel_call, kept by the first probe


def _without_gram(jit, grid, compile_only=False):
    """``replay_launch.kernel_call`` with the gram kernel's launches left out (``--no-gram``)."""
    from ssu_backend_triton.replay import launch as replay_launch

    if jit is replay_launch.gram_kernel:
        return lambda *args, **kwargs: None
    return _KERNEL_CALL(jit, grid, compile_only)


def main(argv=None) -> None:
    import torch
    import triton

    import ssu

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--state-dtype", default="fp32,bf16")
    ap.add_argument("--batches", default="128,1024")
    ap.add_argument(
        "--plans",
        default="8:1:8:4",
        help="block_p:num_warps:tiles:stages[:fold heads[:stepwise]], comma separated",
    )
    ap.add_argument("--kernels", default="ssu_backend_triton.replay.kernel")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--window", type=int, default=15)
    ap.add_argument("--shape", default="128,64,128,8", help="H,P,N,G")
    ap.add_argument("--tokens", type=int, default=1, help="tokens per step (above 1: speculative)")
    ap.add_argument(
        "--fold-shapes",
        default="",
        help="rows:warps:stages:concurrent of the fold kernel, comma separated (default: the shipped one)",
    )
    ap.add_argument("--no-gram", action="store_true", help="also time each plan without the gram kernel's launch")
    args = ap.parse_args(argv)
    from ssu_backend_triton.replay import launch as replay_launch

    shipped = (replay_launch.FOLD_ROWS, replay_launch.FOLD_WARPS, replay_launch.FOLD_STAGES)
    shipped_text = ":".join(str(v) for v in (*shipped, int(replay_launch.FOLD_CONCURRENT)))
    fold_shapes = (args.fold_shapes or shipped_text).split(",")
    H, P, N, G = (int(v) for v in args.shape.split(","))
    versions = f"torch {torch.__version__} | triton {triton.__version__}"
    print(f"{torch.cuda.get_device_name()} | {versions} | H{H} P{P} N{N} G{G} | T{args.tokens}")
    print(f"{'kernel':>28} {'state':>5} {'batch':>5} {'plan':>18} {'regime':>8} {'us':>8} {'TB/s':>6} {'ceil%':>6}")
    for state_dtype in args.state_dtype.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            problem = ssu.Problem(
                nheads=H, headdim=P, dstate=N, ngroups=G, state_dtype=state_dtype, input_dtype="bf16",
                num_slots=batch, max_batch=batch, device="cuda", tokens_per_step=args.tokens,
                speculative=args.tokens > 1,
            )  # fmt: skip
            for kernel in args.kernels.split(","):
                for plan_text, fold_text in (
                    (pt, ft)
                    for pt in args.plans.split(",")
                    for ft in (fold_shapes if pt.count(":") > 3 and int(pt.split(":")[4]) else ["-"])
                ):
                    plan = tuple(int(v) for v in plan_text.split(":"))
                    if fold_text != "-":
                        rows, warps, stages, concurrent = (int(v) for v in fold_text.split(":"))
                        replay_launch.FOLD_ROWS, replay_launch.FOLD_WARPS = rows, warps
                        replay_launch.FOLD_STAGES, replay_launch.FOLD_CONCURRENT = stages, bool(concurrent)
                        plan_text = f"{plan_text}/{fold_text}"
                    for regime, gram in (
                        (r, g) for r in args.regimes.split(",") for g in (True, False)[: 1 + args.no_gram]
                    ):
                        label = regime if gram else f"{regime}-g"
                        try:
                            us, nbytes = probe(kernel, problem, batch, plan, regime, args.window, gram)
                        except Exception as exc:  # one failing variant does not stop the others
                            print(f"{kernel[-28:]:>28} {state_dtype:>5} {batch:5d} {plan_text:>18} {label:>8} "
                                  f"failed: {type(exc).__name__}: {str(exc)[:200]}")  # fmt: skip
                            continue
                        tbs = nbytes / us / 1e6
                        print(f"{kernel[-28:]:>28} {state_dtype:>5} {batch:5d} {plan_text:>18} {label:>8} "
                              f"{us:8.1f} {tbs:6.2f} {100 * tbs * 1e12 / CEILING:5.0f}%", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
