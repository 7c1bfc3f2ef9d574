"""Helpers of the triton backend's tests."""

from __future__ import annotations


import torch

from ssu.harness import compare_with_reference, open_pair, seeded_states  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def compare_steps(problem, gen, *, kernel_options=None, **kwargs):
    """The triton backend against the reference (see ``ssu.harness.compare_with_reference``)."""
    return compare_with_reference("triton", problem, gen, backend_options=kernel_options, **kwargs)
