"""Whether Triton runs kernels through its interpreter here (``TRITON_INTERPRET=1``): what the plugin's
probe, the launches and the tuner each ask, from this module of its own so that none of them imports
another for it."""

from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"
