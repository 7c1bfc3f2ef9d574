"""ssu backend ``triton-replay``: a checkpoint and a ring of recent inputs per slot, stepped by our
own Triton kernels (see ``plugin`` for the hooks), built on the ``triton`` backend's modules in the
package above (availability rules, tuning cache, launch helpers, shared tiles).

Importing this package imports neither torch nor triton.
"""
