"""The ``reference`` backend: pure PyTorch, every feature of SPEC.md, any device torch supports.

It is the correctness oracle of every other backend (and is itself tested against the float64
statement in :mod:`ssu.oracle`). Registered through ssu-core's own ``ssu.backends`` entry point,
like any third-party backend. This module imports no torch until a kernel is opened.
"""

from __future__ import annotations

from ..hookspecs import hookimpl
from ..records import PLUGIN_API_VERSION, BackendSpec, Capabilities

NAME = "reference"


def _factory(ctx):
    from .math import make_step

    return make_step(ctx)


@hookimpl
def ssu_backend():
    return BackendSpec(
        name=NAME,
        api_version=PLUGIN_API_VERSION,
        factory=_factory,
        capabilities=Capabilities(devices={"cpu", "cuda", "mps", "xpu"}, max_tokens_per_step=64, speculative=True),
        description="pure PyTorch reference (fp32 math); the correctness oracle, works anywhere",
        url="https://github.com/ssu-project/ssu",
        priority=-1000,
    )


@hookimpl
def ssu_probe(device):
    from ..devices import torch_device_availability

    return torch_device_availability(device)


@hookimpl
def ssu_allocate_state(ctx, num_layers):
    from .. import slot_state

    return slot_state.allocate(ctx.problem, num_layers, NAME)


@hookimpl
def ssu_commit(ctx, state, slots, num_accepted):
    from .. import slot_state

    slot_state.commit(state, slots, num_accepted)


@hookimpl
def ssu_read_state(ctx, state, slots, layer):
    from .. import slot_state

    return slot_state.read(state, slots, layer)


@hookimpl
def ssu_write_state(ctx, state, slots, values, layer):
    from .. import slot_state

    slot_state.write(state, slots, values, layer)
