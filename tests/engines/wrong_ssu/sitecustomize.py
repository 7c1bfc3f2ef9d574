"""Loaded by every Python process started with this folder on ``PYTHONPATH`` (vLLM's front end,
engine core and workers in tests/engines/test_vllm_generation.py): makes ssu's reference backend
deliberately wrong, so that a test can show that the generated tokens depend on the SSU ssu
serves (a generation that gives the same tokens with a wrong SSU proves nothing about the right
one). ``SSU_WRONG`` says how:

- ``bc`` (the default): the one-token step and the packed call take B for C and C for B;
- ``counts``: the packed call drops vLLM's accepted counts, so each sequence starts from its
  table's first column whatever vLLM accepted (a wrong start slot);
- ``nothing``: the one-token step and the packed call compute nothing: their outputs are zeros and
  no state is written.

The wrong functions are put into ``ssu.reference.math`` and ``ssu.reference.engine_forms`` as
those modules are imported, before the reference backend takes them. Python imports one
``sitecustomize`` only: the next one on ``PYTHONPATH`` (speculative_conv's) is run from here.
"""

from __future__ import annotations

import importlib.abc
import os
import sys

HOW = os.environ.get("SSU_WRONG", "bc")


def _wrong_step(make_step):
    def make_wrong_step(ctx):
        step = make_step(ctx)

        def wrong_step(
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
        ):  # fmt: skip - the contract's signature, which ssu checks
            if HOW == "nothing":
                return x.new_zeros(x.shape) if out is None else out.zero_()
            if HOW == "bc":
                B, C = C, B
            return step(state, x, dt, A, B, C, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots)

        return wrong_step

    return make_wrong_step


def _wrong_packed(make_packed):
    def make_wrong_packed(ctx):
        packed = make_packed(ctx)

        def wrong_packed(
            state,
            x,
            dt,
            A,
            B,
            C,
            slots,
            dst_slots=None,
            num_accepted=None,
            cu_seqlens=None,
            D=None,
            z=None,
            dt_bias=None,
            dt_softplus=False,
            out=None,
            layer=0,
        ):  # fmt: skip - the contract's signature, which ssu checks
            if HOW == "nothing":
                return x.new_zeros(x.shape) if out is None else out.zero_()
            if HOW == "bc":
                B, C = C, B
            if HOW == "counts":
                num_accepted = None
            return packed(state, x, dt, A, B, C, slots, dst_slots, num_accepted, cu_seqlens, D, z, dt_bias, dt_softplus,
                          out, layer)  # fmt: skip

        return wrong_packed

    return make_wrong_packed


#: module -> (its factory's name, the wrapper that makes it wrong)
TARGETS = {
    "ssu.reference.math": ("make_step", _wrong_step),
    "ssu.reference.engine_forms": ("make_packed", _wrong_packed),
}


class _Patch(importlib.abc.MetaPathFinder):
    """Wraps the reference backend's factories as their modules are imported."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        name, wrong = TARGETS[fullname]

        def exec_module(module):
            run(module)
            setattr(module, name, wrong(getattr(module, name)))

        spec.loader.exec_module = exec_module
        return spec


def _run_the_next_sitecustomize() -> None:
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        candidate = os.path.join(entry, "sitecustomize.py")
        if entry and os.path.abspath(entry) != here and os.path.exists(candidate):
            spec = importlib.util.spec_from_file_location("_next_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


sys.meta_path.insert(0, _Patch())
_run_the_next_sitecustomize()
