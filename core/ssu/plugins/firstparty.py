"""Backends this project publishes: how to install each one when it is missing."""

from __future__ import annotations

#: backend name -> distribution that provides it
FIRST_PARTY = {
    "reference": "ssu-core",
    "triton": "ssu-backend-triton",
    "triton-replay": "ssu-backend-triton",
    "flashinfer": "ssu-backend-flashinfer",
    "flashinfer-replayssm": "ssu-backend-flashinfer-replayssm",
}

CORE_DISTRIBUTION = "ssu-core"
RESERVED = "reference"


def install_hint(name: str) -> str:
    """The pip command that installs first-party backend ``name``: from a folder of the project's
    wheels (``scripts/build-wheels`` in its repository builds them) until the distributions are on
    a public index."""
    return f"pip install --find-links <wheel folder> {FIRST_PARTY[name]}"
