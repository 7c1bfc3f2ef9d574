"""Repository-wide pytest set-up: without a CUDA device Triton runs in its interpreter (set before
anything imports triton), for the cross-distribution tests that use it, and torch runs on one
thread. The ``gpu`` marker and its skip come from ssu-core's pytest plugin (``ssu.testing.plugin``)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the tests' tensors are small, and OpenMP's workers spin between small operations: on 2 cores
    # beside another job `python -m pytest` took 4 min 57 s and 5 min 20 s on one thread against
    # 6 min 14 s and 6 min 1 s on torch's default two (2026-12-07)
    torch.set_num_threads(1)
