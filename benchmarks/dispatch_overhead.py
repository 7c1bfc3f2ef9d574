"""Host time that ``kernel.step`` and ``ssu.selective_state_update`` add over calling the
backend's step callable directly.

A no-op backend (its step returns ``out`` at once) makes the framework's own cost visible: the
validated wrapper (``validate = true``: its per-signature checks), the wrapper-free kernel
(``validate = false``) and the drop-in call with the arguments a transformers Mamba2 mixer passes
(dt, A, D and dt_bias expanded over P and N, no state indices). Prints; asserts nothing.

    python benchmarks/dispatch_overhead.py [--calls N] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import ssu
from ssu.checking.inputs import pick_slots, step_inputs


class NoOpBackend:
    """A backend whose step does nothing: what remains is dispatch and validation."""

    @ssu.hookimpl
    def ssu_backend(self):
        def factory(ctx):
            def step(
                state,
                x,
                dt,
                A,
                B,
                C,
                slots,
                D=None,
                z=None,
                dt_bias=None,
                dt_softplus=False,
                out=None,
                layer=0,
                dst_slots=None,
            ):
                return out

            return step

        return ssu.BackendSpec(
            name="noop",
            api_version=ssu.PLUGIN_API_VERSION,
            factory=factory,
            capabilities=ssu.Capabilities(
                speculative=True,
                max_tokens_per_step=8,
                guards_slots=True,
                adopt_state=True,
                tied_inputs=True,
                destination_slots=True,
                any_pad_slot_id=True,
            ),
        )

    @ssu.hookimpl
    def ssu_allocate_state(self, ctx, num_layers):
        return ssu.State("noop", ctx.problem, num_layers, {})

    @ssu.hookimpl
    def ssu_adopt_state(self, ctx, cache):
        return ssu.State("noop", ctx.problem, len(cache), {}, cache=cache)

    @ssu.hookimpl
    def ssu_read_state(self, ctx, state, slots, layer):
        raise NotImplementedError

    @ssu.hookimpl
    def ssu_write_state(self, ctx, state, slots, values, layer):
        raise NotImplementedError

    @ssu.hookimpl
    def ssu_commit(self, ctx, state, slots, num_accepted):
        pass


def per_call_ns(fn, calls: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean time per call, in ns."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    ssu.register_backend(NoOpBackend())
    H, P, N, G, b = 128, 64, 128, 8, 32
    problem = ssu.Problem(nheads=H, headdim=P, dstate=N, ngroups=G, num_slots=64, max_batch=b, device=args.device)
    gen = torch.Generator().manual_seed(0)
    slots = pick_slots(problem, b, gen)
    inputs = step_inputs(problem, slots, gen).kwargs()
    out = torch.empty_like(inputs["x"])
    rows = []
    for validate in (False, True):
        kernel = ssu.open(ssu.Config(backend="noop", validate=validate), problem)
        kwargs = dict(inputs, state=kernel.allocate_state(num_layers=1), out=out, layer=0)
        direct = per_call_ns(lambda k=kernel, kw=kwargs: k.raw_step(**kw), args.calls)
        through = per_call_ns(lambda k=kernel, kw=kwargs: k.step(**kw), args.calls)
        rows.append((f"kernel.step, validate={str(validate).lower()}", direct, through))
    # the drop-in, called as a transformers Mamba2 mixer calls its SSU
    config = ssu.Config(backend="noop")
    cache = torch.zeros(b, H, P, N, device=args.device)
    x, B, C = inputs["x"], inputs["B"], inputs["C"]
    dt = inputs["dt"][:, :, None].expand(-1, -1, P)
    A = inputs["A"][:, None, None].expand(-1, P, N)
    D, dt_bias = inputs["D"][:, None].expand(-1, P), inputs["dt_bias"][:, None].expand(-1, P)
    dropin = lambda: ssu.selective_state_update(cache, x, dt, A, B, C, D, None, dt_bias, True, config=config)  # noqa
    dropin()
    kernel, state = ssu.dropin.served(cache, config)
    arange = torch.arange(b, dtype=torch.int32, device=args.device)
    same = lambda: kernel.step(state, x, dt, A, B, C, arange, D, None, dt_bias, True)  # noqa: E731
    rows.append(
        (
            "selective_state_update (tied, vs kernel.step)",
            per_call_ns(same, args.calls),
            per_call_ns(dropin, args.calls),
        )
    )
    print(
        f"dispatch overhead, {platform.python_implementation()} {platform.python_version()}, "
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.calls} calls x 7, median"
    )
    print(f"{'path':48s} {'baseline ns':>12s} {'through ns':>11s} {'added ns':>9s}")
    for name, base, through in rows:
        print(f"{name:48s} {base:12.0f} {through:11.0f} {through - base:9.0f}")
    print("baseline: the backend's callable (kernel.step rows) or kernel.step with validation on (the drop-in row)")


if __name__ == "__main__":
    main()
