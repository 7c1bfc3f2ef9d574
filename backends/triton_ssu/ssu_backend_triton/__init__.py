"""ssu backend ``triton``: our own Triton SSU kernel (see ``plugin`` for the hooks).

Importing this package imports neither torch nor triton; the kernel module is imported when a
kernel is opened.
"""

__version__ = "0.1.0"
