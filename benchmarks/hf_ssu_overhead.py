"""Where the time of a transformers decode step's SSU goes on the patched path, layer by layer.

A transformers Mamba2-family model (random weights, ``--preset`` mixer shapes) generates once
through ``ssu.integrations.transformers.patch``; the arguments its first decode-step SSU call
receives are kept, and each level of the path is then timed with them, eagerly, one call after
another as a decode step makes them (host time per call, the device synchronised at the end of
each run, median of runs):

- ``zeros``: the null SSU ``ssu compare`` measures the share against (``x.new_zeros``);
- ``launcher``: Triton's C launcher alone, with the arguments the triton step passes it (when the
  step launches directly);
- ``raw``: the backend's step callable (``kernel.raw_step``);
- ``kernel.step``: with the kernel's validation (once per input signature);
- ``cache lane``: the kernel's cache lane alone (``ssu.dropin.lanes_of``), where it has one;
- ``drop-in``: ``ssu.selective_state_update`` on the model's cache tensor;
- ``patched``: the modeling module's function as the patch left it, inside a patched mixer;
- ``kernel``: the step's device time alone (CUDA events over back-to-back launches).

Then each layer's one-token SSU call clocked where the decode makes it (``hf_models.timed_calls``,
as ``ssu compare`` clocks it; median over ``--rounds`` turns of 15 decode steps), through ssu as it
ships (cache lanes, plugin API 1.7), through ssu with lanes of one adopted tensor only (the
kernels' cache lanes withheld, as for a backend of plugin API 1.6), for the output's allocation
and the Triton launch alone (the floor of any eager Triton SSU there), and for the null SSU.
transformers from 5.25 hands the SSU a fresh copy of the layer's cache at every step, which only a
cache lane serves without adopting it again. Then a decode step of the whole model under torch's
profiler (the ops with the most host time) and under cProfile (the Python functions with the most
time of their own). Prints; asserts nothing.

    python benchmarks/hf_ssu_overhead.py --arch nemotron_h --preset nemotron-h-8b --device cuda
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys

import attrs
import torch

import ssu
import ssu.integrations.transformers as ssu_hf
from ssu.integrations import hf_models
from ssu.measure.timing import host_times_us


def device_us(fn, calls: int) -> float:
    """Device time per call of back-to-back launches, from CUDA events (median of 7 runs)."""
    samples = []
    for _ in range(7):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(samples)


@torch.no_grad()  # as generate runs the model (the adopted state's views were made so)
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="nemotron_h")
    parser.add_argument("--preset", default="nemotron-h-8b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="turns of the in-situ paths (default 3)")
    parser.add_argument(
        "--triton-dispatch",
        action="store_true",
        help="launch the triton kernels through jit[grid] every call (what kept kernels and direct launches save)",
    )
    args = parser.parse_args()
    if args.triton_dispatch:
        from ssu_backend_triton import fast_launch

        fast_launch.launch = lambda jit, grid, *a, **k: jit[grid](*a, **k)
        fast_launch.direct = lambda compiled: None  # no step launched through Triton's launcher itself
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = hf_models.random_model(args.arch, args.preset, args.layers, dtype=dtype, device=args.device)
    ids = hf_models.prompt_ids(model, batch=args.batch)
    mixer = ssu_hf.find_mixers(model)[0][1]
    module_name = type(mixer).__module__
    patch = ssu_hf.patch(model, backend=args.backend)
    hf_models.generate(model, ids, 3)  # opens, adopts and warms the kernels up
    call_args, call_kwargs = hf_models.first_decode_call(model, ids)
    state, x = call_args[0], call_args[1]
    kernel, adopted = ssu.dropin.served(state, patch.config)
    _, _, dt, A, B, C, D = call_args[:7]
    dt_bias, z = call_kwargs.get("dt_bias"), call_kwargs.get("z")
    slots = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    out = torch.empty_like(x)
    module_function = getattr(sys.modules[module_name], ssu_hf.FUNCTION)
    token = ssu_hf._running.set(patch.serving)
    levels = {
        "zeros": lambda: x.new_zeros(x.shape),
        "raw": lambda: kernel.raw_step(adopted, x, dt, A, B, C, slots, D, z, dt_bias, True, out, 0, None),
        "kernel.step": lambda: kernel.step(adopted, x, dt, A, B, C, slots, D, z, dt_bias, True, out, 0, None),
        "drop-in": lambda: ssu.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, True, config=patch.config),
        "patched": lambda: module_function(*call_args, **call_kwargs),
    }
    table, key = ssu.dropin.lanes_of(patch.config)
    if table.get(key):
        lane = table[key][0]
        levels["cache lane"] = lambda: lane(state, x, dt, A, B, C, D, z, dt_bias, True)
    launcher = kept_launch(kernel, levels["raw"])
    if launcher is not None:
        levels["launcher"] = launcher
    # each level adds to the one before it in its path: the patched path's, then the step's
    order = ("zeros", "launcher", "cache lane", "drop-in", "patched", "raw", "kernel.step")
    adds_to = {"cache lane": "launcher", "drop-in": "cache lane", "patched": "drop-in", "kernel.step": "raw"}
    levels = {name: levels[name] for name in order if name in levels}
    print(
        f"hf_ssu_overhead: {args.arch} {args.preset} ({kernel.problem.describe()}), {args.dtype} model, "
        f"batch {args.batch}, backend {kernel.backend}"
        f"{' (launched through jit[grid])' if args.triton_dispatch else ''}; torch {torch.__version__}, "
        f"{torch.cuda.get_device_name() if args.device.startswith('cuda') else 'cpu'}"
    )
    print(f"{'level':14s} {'host us/call':>13s} {'added us':>9s}")
    timed: dict = {}
    for name, fn in levels.items():
        us = timed[name] = host_times_us({name: fn}, count=args.calls, cuda=args.device.startswith("cuda"))[name]
        before = adds_to.get(name)
        added = f"{us - timed[before]:9.1f}" if before in timed else ""
        print(f"{name:14s} {us:13.1f} {added:>9s}")
    if args.device.startswith("cuda"):
        print(f"{'kernel':14s} {device_us(levels['raw'], args.calls):13.1f}   (device time per launch)")
    ssu_hf._running.reset(token)
    patch.undo()
    in_situ(model, ids, patch.config, args.rounds, launcher)
    patch = ssu_hf.patch(model, config=patch.config)

    print("\none decode step of the patched model, torch profiler (host time):")
    hf_models.generate(model, ids, 2)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        hf_models.generate(model, ids, 4)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))

    print("cProfile of a generate of 8 tokens (own time):")
    profiler = cProfile.Profile()
    profiler.enable()
    hf_models.generate(model, ids, 8)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    print(text.getvalue())
    if args.device.startswith("cuda"):
        print_synchronising_calls(model, ids)
    patch.undo()


def in_situ(model, ids, config, rounds: int, launcher=None) -> None:
    """Median host time of a layer's one-token SSU call inside greedy decodes of 16 tokens, per
    path, the paths taking turns (each path opens its kernels afresh and warms up first). With
    ``launcher`` (:func:`kept_launch`'s), also the floor of an eager Triton SSU there: the
    output's allocation and that one launch alone (on the first decode call's tensors; timing
    only), what a call through ssu pays beyond it being ssu's own host work. With the triton
    backend, its cache lanes also as Python (``compiled_lanes = false``)."""
    import transformers

    def withheld(*args, **kwargs):
        return None

    def launch_alone(function):
        def call(state, x, *args, **kwargs):
            out = x.new_empty(x.shape)
            launcher()
            return out

        return call

    floor = "launch and allocation alone"
    python_lanes = "ssu, cache lanes in Python"
    configs = {name: config for name in ("ssu, cache lanes", "ssu, lanes of one tensor")}
    if "triton" in config.candidates:  # its lanes compiled (as it ships) and in Python
        tables = {**config.backends, "triton": {**config.options_for("triton"), "compiled_lanes": False}}
        configs[python_lanes] = attrs.evolve(config, backends=tables)
    paths = (*configs, *((floor,) if launcher else ()), "zeros")
    seconds: dict = {name: [] for name in paths}
    shipped = ssu.Kernel.cache_lane
    for _ in range(rounds):
        for name in paths:
            ssu.dropin.clear()
            ssu.Kernel.cache_lane = withheld if name == "ssu, lanes of one tensor" else shipped
            try:
                if name == "zeros":
                    context = hf_models.null_ssu(model)
                elif name == floor:
                    context = hf_models.replaced_ssu(model, launch_alone)
                else:
                    context = ssu_hf.patch(model, config=configs[name])
                with context:
                    hf_models.generate(model, ids, 2)
                    with hf_models.timed_calls(model) as calls:
                        hf_models.generate(model, ids, 16)
            finally:
                ssu.Kernel.cache_lane = shipped
            seconds[name].extend(calls)
    ssu.dropin.clear()
    zeros = statistics.median(seconds["zeros"]) * 1e6
    print(f"\nin-situ one-token SSU calls (transformers {transformers.__version__}, {rounds} rounds of 15 steps):")
    print(f"{'path':28s} {'calls':>6s} {'host us/call':>13s} {'above zeros':>12s}")
    for name in paths:
        us = statistics.median(seconds[name]) * 1e6
        above = "" if name == "zeros" else f"{us - zeros:12.1f}"
        print(f"{name:28s} {len(seconds[name]):6d} {us:13.1f} {above:>12s}")


def kept_launch(kernel, raw):
    """Triton's C launcher called alone with the arguments the triton step passed it at ``raw()``
    (the floor of an eager launch from Python), or None for a step that launches otherwise."""
    launches = getattr(kernel.raw_step, "launches", None)
    if launches is None:
        return None
    raw()
    captured = []
    saved = {form: list(layouts) for form, layouts in launches.direct.items()}

    def capturing(c_launch):
        def capture(*a):
            captured.append((c_launch, a))
            return c_launch(*a)

        return capture

    for form, layouts in saved.items():
        launches.direct[form] = [(guard, (capturing(c_launch), *rest)) for guard, (c_launch, *rest) in layouts]
    raw()
    launches.direct.update(saved)
    if not captured:
        return None
    c_launch, arguments = captured[-1]
    return lambda: c_launch(*arguments)


def print_synchronising_calls(model, ids) -> None:
    """Every call on ssu's side of a patched generate that makes the host wait for the device
    (torch's sync debug mode, warnings kept by the innermost frames of ssu's code): a wait inside
    a layer's SSU turns the queued work of the layers before it into host time of the decode."""
    import collections
    import traceback
    import warnings

    stacks: collections.Counter = collections.Counter()
    everywhere = [0]

    def keep(message, category, filename, lineno, file=None, line=None):
        everywhere[0] += 1
        frames = [f for f in traceback.extract_stack()[:-1] if "ssu" in f.filename and __file__ not in f.filename]
        if frames:
            stacks[" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in frames[::-1][:4])] += 1

    hf_models.generate(model, ids, 2)
    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = keep
        torch.cuda.set_sync_debug_mode("warn")
        try:
            hf_models.generate(model, ids, 4)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = shown
    print(f"\nsynchronising calls in a patched generate of 4 tokens: {everywhere[0]} in all, from ssu's code:")
    for stack, count in stacks.most_common(10):
        print(f"{count:5d}  {stack}")
    if not stacks:
        print("    none")


if __name__ == "__main__":
    main()
