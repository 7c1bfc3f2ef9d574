"""Can FlashInfer run here? Each failure names its cause and the command that fixes it.

Checked without importing flashinfer: the installed version (metadata), the device, its compute
capability, and a CUDA compiler for FlashInfer's JIT (it compiles kernels on first use).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
from pathlib import Path

import ssu

MIN_VERSION = (0, 7, 4)
DISTRIBUTION = "flashinfer-python"
PIP = f"pip install '{DISTRIBUTION}>=0.7.4'"


def _version_tuple(text: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def find_nvcc() -> str | None:
    """Path of the nvcc FlashInfer's JIT would use (CUDA_HOME first), or None."""
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.is_file() else None


def flashinfer_availability(device: str) -> ssu.Availability:
    """Whether FlashInfer's SSU can run on ``device``: installed, recent enough, a CUDA GPU it supports."""
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return ssu.Availability(False, f"{DISTRIBUTION} is not installed", PIP)
    if _version_tuple(version) < MIN_VERSION:
        return ssu.Availability(
            False,
            f"{DISTRIBUTION} {version} is older than 0.7.4 (0.7.2 fails to compile for head dims 32 and 96)",
            f"pip install -U '{DISTRIBUTION}>=0.7.4'",
        )
    kind = str(device).split(":", 1)[0]
    if kind != "cuda":
        return ssu.Availability(
            False,
            f"FlashInfer runs on CUDA devices only, not {device!r}",
            "use device='cuda'; on the CPU the reference backend serves (the triton backends only in "
            "Triton's interpreter, TRITON_INTERPRET=1, for tests)",
        )
    from ssu.contract.devices import torch_device_availability

    availability = torch_device_availability(device)
    if not availability.available:
        return availability
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 0):
        return ssu.Availability(
            False,
            f"compute capability {major}.{minor} is below 8.0, FlashInfer's minimum",
            "use an Ampere or newer GPU",
        )
    if find_nvcc() is None:
        return ssu.Availability(
            False,
            "no nvcc found (CUDA_HOME unset and nvcc not on PATH); FlashInfer "
            "compiles its kernels with it on first use",
            "install the CUDA toolkit and export CUDA_HOME=/usr/local/cuda (or wherever it is)",
        )
    return ssu.AVAILABLE


def compute_capability(device: str) -> tuple:
    """The (major, minor) compute capability of a CUDA device."""
    import torch

    return torch.cuda.get_device_capability(device)
