"""ssu backends ``triton`` and ``triton-replay``: our own Triton SSU kernels.

The modules here are the ``triton`` backend (see ``plugin`` for the hooks) and what both backends
share: availability rules, the tuning cache, launch helpers and the kernels' tiles; ``replay``
holds what serves ``triton-replay`` alone. Importing this package imports neither torch nor
triton; the kernel modules are imported when a kernel is opened.
"""

__version__ = "0.1.0"
