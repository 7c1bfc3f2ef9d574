"""Host time that ``kernel.step`` adds over calling the backend's step callable directly.

A no-op backend (its step returns ``out`` at once) makes the framework's own cost visible.
Target: at most 1 us per call. Prints; asserts nothing.

    python benchmarks/dispatch_overhead.py [--calls N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import ssu
from ssu.inputs import pick_slots, step_inputs


class NoOpBackend:
    """A backend whose step does nothing: what remains is dispatch and validation."""

    @ssu.hookimpl
    def ssu_backend(self):
        def factory(ctx):
            def step(state, x, dt, A, B, C, slots, D=None, z=None, dt_bias=None, dt_softplus=False, out=None, layer=0,
                     dst_slots=None):
                return out
            return step

        return ssu.BackendSpec(name="noop", api_version=ssu.PLUGIN_API_VERSION, factory=factory,
                               capabilities=ssu.Capabilities(speculative=True, max_tokens_per_step=8, guards_slots=True))

    @ssu.hookimpl
    def ssu_allocate_state(self, ctx, num_layers):
        return ssu.State("noop", ctx.problem, num_layers, {})

    @ssu.hookimpl
    def ssu_read_state(self, ctx, state, slots, layer):
        raise NotImplementedError

    @ssu.hookimpl
    def ssu_write_state(self, ctx, state, slots, values, layer):
        raise NotImplementedError

    @ssu.hookimpl
    def ssu_commit(self, ctx, state, slots, num_accepted):
        pass


def per_call_ns(fn, kwargs, calls: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean time per call, in ns."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn(**kwargs)
        samples.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    ssu.register_backend(NoOpBackend())
    problem = ssu.Problem(nheads=128, headdim=64, dstate=128, ngroups=8, num_slots=64, max_batch=32, device=args.device)
    gen = torch.Generator().manual_seed(0)
    slots = pick_slots(problem, 32, gen)
    inputs = step_inputs(problem, slots, gen).kwargs()
    rows = []
    for validate in (False, True):
        kernel = ssu.open(ssu.Config(backend="noop", validate=validate), problem)
        state = kernel.allocate_state(num_layers=1)
        kwargs = dict(inputs, state=state, out=torch.empty_like(inputs["x"]), layer=0)
        direct = per_call_ns(kernel.raw_step, kwargs, args.calls)
        through = per_call_ns(kernel.step, kwargs, args.calls)
        rows.append((f"validate={validate}", direct, through, through - direct))
    print(f"dispatch overhead, {platform.python_implementation()} {platform.python_version()}, "
          f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.calls} calls x 7, median")
    print(f"{'mode':16s} {'direct ns':>10s} {'kernel.step ns':>15s} {'added ns':>10s}")
    for name, direct, through, added in rows:
        print(f"{name:16s} {direct:10.0f} {through:15.0f} {added:10.0f}")
    print("target: added <= 1000 ns per call")


if __name__ == "__main__":
    main()
