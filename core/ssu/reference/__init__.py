"""The ``reference`` backend: pure PyTorch, every feature of docs/spec.md, any device torch supports.

It is the correctness oracle of every other backend (and is itself tested against the float64
statement in :mod:`ssu.checking.oracle`). Registered through ssu-core's own ``ssu.backends`` entry point,
like any third-party backend. This module imports no torch until a kernel is opened.
"""

from __future__ import annotations

from ..contract.hookspecs import hookimpl
from ..contract.records import PLUGIN_API_VERSION, BackendSpec, Capabilities

NAME = "reference"


def _factory(ctx):
    from .math import make_step

    return make_step(ctx)


@hookimpl
def ssu_backend():
    """Declare the reference backend: every device torch runs on, every dtype and option, any shape."""
    return BackendSpec(
        name=NAME,
        api_version=PLUGIN_API_VERSION,
        factory=_factory,
        capabilities=Capabilities(
            devices={"cpu", "cuda", "mps", "xpu"},
            state_dtypes={"fp32", "bf16", "fp16", "int8", "fp8_e4m3"},
            max_tokens_per_step=64,
            speculative=True,
            adopt_state=True,
            destination_slots=True,
            any_pad_slot_id=True,
            guards_slots=True,
            tied_inputs=True,
            engine_calls={"packed", "verify", "tree"},
        ),
        description="pure PyTorch reference (fp32 math); the correctness oracle, works anywhere",
        url="https://github.com/ssu-project/ssu",
        priority=-1000,
    )


@hookimpl
def ssu_engine_call(ctx, form):
    """vLLM's packed call and SGLang's verify call, in plain PyTorch (:mod:`.engine_forms`)."""
    from .engine_forms import make_packed, make_verify

    return make_packed(ctx) if form == "packed" else make_verify(ctx)


@hookimpl
def ssu_probe(device):
    """Available wherever torch can allocate on the device."""
    from ..contract.devices import torch_device_availability

    return torch_device_availability(device)


# state, commit, read and write: the versioned-slot layout shared with the other built-in backends
from ..state.slot_state import (  # noqa: E402, F401 - registered as this backend's hooks
    ssu_adopt_state,
    ssu_allocate_state,
    ssu_commit,
    ssu_read_state,
    ssu_write_state,
)
