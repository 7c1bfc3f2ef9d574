"""Whether torch can reach a device here: the availability check every backend starts with."""

from __future__ import annotations

from .records import AVAILABLE, Availability


def torch_device_availability(device: str) -> Availability:
    """Availability of ``device`` ("cpu", "cuda", "cuda:1", ...) through torch (imports torch)."""
    import torch

    kind, _, index = str(device).partition(":")
    if kind == "cpu":
        return AVAILABLE
    if kind == "cuda":
        if not torch.cuda.is_available():
            return Availability(False, "no CUDA device is visible to torch",
                                "run on a machine with an NVIDIA GPU and a CUDA build of torch, or use device='cpu'")
        if index and int(index) >= torch.cuda.device_count():
            return Availability(False, f"{device} does not exist ({torch.cuda.device_count()} CUDA device(s) visible)",
                                "pick an existing device index or check CUDA_VISIBLE_DEVICES")
        return AVAILABLE
    backend = getattr(torch, kind, None)
    if backend is not None and hasattr(backend, "is_available") and backend.is_available():
        return AVAILABLE
    return Availability(False, f"torch cannot reach a {kind!r} device here", "use device='cpu' or 'cuda'")
