"""Launch shapes of the triton backend against an engine's own SSU kernel, on the engine's calls as
``ssu bench --engine`` builds them (``ssu.bench.engines``): per engine, call form, state dtype and
batch, the engine's kernel, the triton backend as configured by default, and each shape given,
every contender timed in several interleaved rounds (CUDA-graph replays over slot sets that keep
the L2 cold, the median of each round; the table shows the median over rounds and each
contender's time over the engine kernel's). Each contender is first compared with the engine's
kernel on the cell's first call; a cell outside twice the spec's budgets prints MISMATCH.

    python benchmarks/engine_shapes.py --engine-wheel .device/engines --engines vllm,sglang \
        --batches 1,2,4,8 --decode 4:1,8:1,16:2 --calls 4:1:1:1,8:1:1:1,4:1:0:0

``--decode`` shapes pin the one-token step's schedule (block_p:warps[:tiles:stages[:pdl[:branchless]]],
as the ``[ssu.backends.triton]`` options do); ``--calls`` shapes pin the speculative and verify
calls' launch (block_p:warps:prefetch:pdl, ``ssu_backend_triton.engine_launch.Shape``).
``--device cpu`` (with ``TRITON_INTERPRET=1``) is a smoke run at a small shape: it checks the
contenders against the engine's kernel, and its wall-clock times mean nothing.
"""

from __future__ import annotations

import argparse
import statistics


def decode_config(spec: str):
    """A Config pinning the one-token step's schedule ``block_p:warps[:tiles:stages[:pdl[:branchless]]]``."""
    from ssu.plugins.config import Config

    v = [int(s) for s in spec.split(":")]
    options = dict(block_p=v[0], num_warps=v[1])
    if len(v) > 3:
        options.update(tiles_per_program=v[2], loop_stages=v[3])
    if len(v) > 4:
        options["programmatic_launch"] = bool(v[4])
    if len(v) > 5:
        options["branchless_inputs"] = bool(v[5])
    return Config(backend="triton", backends={"triton": options})


class CallShape:
    """A drop-in call whose engine-call kernels take the launch shape ``block_p:warps:prefetch:pdl``
    at every batch (``engine_launch.default_shape`` replaced while it runs, so that the kernel it
    opens takes it)."""

    def __init__(self, spec: str) -> None:
        from ssu.bench.engines import drop_in
        from ssu_backend_triton.engine_launch import Shape

        self.shape = Shape(*[int(s) for s in spec.split(":")])
        self.call = drop_in("triton")

    def __call__(self, state, **kwargs):
        from ssu_backend_triton import engine_launch

        default, engine_launch.default_shape = engine_launch.default_shape, lambda p, b=0: self.shape
        try:
            return self.call(state, **kwargs)
        finally:
            engine_launch.default_shape = default


def contenders(args, form: str, engine_call) -> list:
    """(name, callable) of one cell: the engine's kernel, the default triton backend, the shapes."""
    from ssu.bench.engines import drop_in

    out = [(args.engine_name, engine_call), ("triton", drop_in("triton"))]
    if form == "decode":
        out += [(f"d{spec}", _decode_calls[spec]) for spec in args.decode]
    else:
        out += [(f"c{spec}", _call_shapes[spec]) for spec in args.calls]
    return out


_decode_calls: dict = {}
_call_shapes: dict = {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine-wheel", default=".device/engines")
    parser.add_argument("--engines", default="vllm,sglang")
    parser.add_argument("--forms", default="", help="call forms to run (default: each engine's)")
    parser.add_argument("--state-dtype", default="fp32,bf16")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--decode", default="", help="one-token schedules, comma-separated")
    parser.add_argument("--calls", default="", help="speculative and verify launch shapes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run in Triton's interpreter")
    args = parser.parse_args()
    args.decode = [s for s in args.decode.split(",") if s]
    args.calls = [s for s in args.calls.split(",") if s]

    import torch
    import triton

    from ssu.bench import engine_kernels, engines
    from ssu.bench.engines import budgets, build, compare
    from ssu.bench.measure import wall_time_us
    from ssu.measure.timing import graph_time_us

    smoke = args.device == "cpu"
    timer = wall_time_us if smoke else graph_time_us
    if smoke:
        engine_kernels.interpreter_masks()

    for spec in args.decode:
        _decode_calls[spec] = _pinned(decode_config(spec))
    for spec in args.calls:
        _call_shapes[spec] = CallShape(spec)

    on = "cpu (smoke run)" if smoke else torch.cuda.get_device_name()
    print("torch", torch.__version__, "triton", triton.__version__, on, flush=True)
    shapes = (
        dict(nheads=4, headdim=8, dstate=16, ngroups=2)
        if smoke
        else dict(nheads=128, headdim=64, dstate=128, ngroups=8)
    )
    forms_wanted = [f for f in args.forms.split(",") if f]
    for name in args.engines.split(","):
        kernel = engine_kernels.load(name, args.engine_wheel)
        args.engine_name = name
        print(f"== {name} {kernel.version} ({kernel.loaded})", flush=True)
        for form in engines.FORMS[name]:
            if forms_wanted and form not in forms_wanted:
                continue
            for state in args.state_dtype.split(","):
                for batch in [int(b) for b in args.batches.split(",")]:
                    built = build(name, form, shapes, state, "bf16", batch, args.device)
                    tokens = engines.SPECULATIVE_TOKENS if form != "decode" else 1
                    budget = budgets(state, "bf16", tokens)
                    timed = []
                    for who, fn in contenders(args, form, kernel.call):
                        if who != name:
                            out_diff, state_diff = compare(name, form, built, kernel.call, fn)
                            if out_diff > budget[0] or state_diff > budget[1]:
                                print(f"MISMATCH {name} {form} {state} b{batch} {who}: {out_diff:.2e} {state_diff:.2e}")
                                continue
                        launches = [
                            (lambda fn=fn, call=call, cache=built.state: fn(cache, **call)) for call in built.sets
                        ]
                        timed.append((who, launches, []))
                    for _ in range(args.rounds):
                        for _who, launches, samples in timed:
                            samples.append(timer(launches, min_launches=args.iterations))
                    base = statistics.median(timed[0][2])
                    cells = "  ".join(
                        f"{who} {statistics.median(s):.2f} ({statistics.median(s) / base:.3f})" for who, _, s in timed
                    )
                    print(f"{name} {form} {state} b{batch}: {cells}", flush=True)
                    del built, timed
                    if not smoke:
                        torch.cuda.empty_cache()


def _pinned(config):
    """``ssu.selective_state_update`` with ``config``, as an engine plugin calls it."""
    from ssu.dropin import selective_state_update

    def call(state, x, dt, A, B, C, **kwargs):
        return selective_state_update(state, x, dt, A, B, C, config=config, **kwargs)

    return call


if __name__ == "__main__":
    main()
