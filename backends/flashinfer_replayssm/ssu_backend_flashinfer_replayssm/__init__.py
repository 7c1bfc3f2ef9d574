"""ssu backend ``flashinfer-replayssm`` (hooks in ``plugin``). Importing it imports neither torch
nor flashinfer."""

__version__ = "0.1.0"
