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
            return Availability(
                False,
                "no CUDA device is visible to torch",
                "run on a machine with an NVIDIA GPU and a CUDA build of torch, or use device='cpu'",
            )
        if index and int(index) >= torch.cuda.device_count():
            return Availability(
                False,
                f"{device} does not exist ({torch.cuda.device_count()} CUDA device(s) visible)",
                "pick an existing device index or check CUDA_VISIBLE_DEVICES",
            )
        return AVAILABLE
    backend = getattr(torch, kind, None)
    if backend is not None and hasattr(backend, "is_available") and backend.is_available():
        return AVAILABLE
    return Availability(False, f"torch cannot reach a {kind!r} device here", "use device='cpu' or 'cuda'")


def available_bytes(device: str):
    """Bytes that could be allocated on ``device`` now (free GPU memory, the host's available
    memory), or None where that cannot be told."""
    kind = str(device).split(":", 1)[0]
    if kind == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return free
    if kind == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        import os

        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def gib(n: int) -> str:
    """``n`` bytes as GiB with one decimal (MiB below one GiB)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
