"""The mixer head shapes of the Mamba2-family models ssu is measured and tested at (per
tensor-parallel rank at tp 1): one table for the command line's ``--model``, ``ssu compare``'s
``--preset`` and the docs (docs/spec.md, "Shapes and names")."""

from __future__ import annotations

#: model -> its mixer's heads, head dimension, state dimension and groups
MODEL_SHAPES = {
    "nemotron-h-8b": dict(nheads=128, headdim=64, dstate=128, ngroups=8),
    "nemotron-3-super": dict(nheads=128, headdim=64, dstate=128, ngroups=8),
    "nemotron-h-56b": dict(nheads=256, headdim=64, dstate=256, ngroups=8),
    "nemotron-3-nano": dict(nheads=64, headdim=64, dstate=128, ngroups=8),
    "nemotron-nano-9b-v2": dict(nheads=128, headdim=80, dstate=128, ngroups=8),
    "granite-4.0-h": dict(nheads=128, headdim=64, dstate=128, ngroups=1),
    "mamba2-2.7b": dict(nheads=80, headdim=64, dstate=128, ngroups=1),
}
