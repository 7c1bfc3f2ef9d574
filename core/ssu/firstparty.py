"""Backends this project publishes: how to install each one when it is missing."""

from __future__ import annotations

#: backend name -> distribution that provides it
FIRST_PARTY = {
    "reference": "ssu-core",
    "triton": "ssu-backend-triton",
    "flashinfer": "ssu-backend-flashinfer",
    "flashinfer-replayssm": "ssu-backend-flashinfer-replayssm",
}

CORE_DISTRIBUTION = "ssu-core"
RESERVED = "reference"


def install_hint(name: str) -> str:
    """The pip command that installs first-party backend ``name``."""
    return f"pip install {FIRST_PARTY[name]}"
