"""Loaded by every Python process started with this folder on ``PYTHONPATH`` (vLLM's front end,
engine core and workers in tests/engines/test_vllm_generation.py): makes ssu's reference backend
deliberately wrong, its one-token step taking B for C and C for B, so that a test can show that
the generated tokens depend on the SSU ssu serves (a generation that gives the same tokens with a
wrong SSU proves nothing about the right one).

The swap is put into ``ssu.reference.math.make_step`` as that module is imported, before the
reference backend takes the function from it.
"""

from __future__ import annotations

import importlib.abc
import sys

TARGET = "ssu.reference.math"


def _swapping(make_step):
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
            return step(state, x, dt, A, C, B, slots, D, z, dt_bias, dt_softplus, out, layer, dst_slots)

        return wrong_step

    return make_wrong_step


class _Patch(importlib.abc.MetaPathFinder):
    """Wraps the reference backend's step factory as its module is imported."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != TARGET:
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

        def exec_module(module):
            run(module)
            module.make_step = _swapping(module.make_step)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
