"""Repository-wide pytest set-up: without a CUDA device Triton runs in its interpreter (set before
anything imports triton), for the cross-distribution tests that use it. The ``gpu`` marker and
its skip come from ssu-core's pytest plugin (``ssu.testing.plugin``)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
