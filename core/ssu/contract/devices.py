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


def total_bytes(device: str):
    """Bytes ``device`` has in all (a GPU's memory, the host's), or None where that cannot be told."""
    kind = str(device).split(":", 1)[0]
    if kind == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[1]
    if kind == "cpu":
        import os

        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def gib(n: int) -> str:
    """``n`` bytes as GiB with one decimal (MiB below one GiB)."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def launch_index(device: str):
    """The CUDA device index to make current around launches for ``device``, or None where none
    is needed. Triton (and some libraries) launch on the *current* device, not the tensors': a
    kernel for ``cuda:1`` must launch with ``cuda:1`` current, whatever the engine's current
    device is.

    None for a device other than CUDA, for ``"cuda"`` without an index (the current device by
    definition), and when one GPU is visible (it is always current): the hot path stays bare on
    a one-GPU machine."""
    kind, _, index = str(device).partition(":")
    if kind != "cuda" or not index:
        return None
    import torch

    if torch.cuda.device_count() < 2:
        return None
    return int(index)


def current(device: str):
    """A context manager that makes ``device`` current for the launches inside it (see
    :func:`launch_index`); a no-op where none is needed."""
    return guard(launch_index(device))


def guard(index):
    """A context manager that makes CUDA device ``index`` current, or a no-op for None (what
    :func:`launch_index` returns where nothing needs switching)."""
    if index is None:
        import contextlib

        return contextlib.nullcontext()
    return _cuda_device(index)


def _cuda_device(index: int):
    """``torch.cuda.device(index)``: the one place this module makes a device current."""
    import torch

    return torch.cuda.device(index)


def on_device(fn, device: str):
    """``fn`` itself where :func:`launch_index` needs nothing, else ``fn`` called with ``device``
    current (same signature, ``__wrapped__`` set). A fresh guard per call: safe across threads
    and nested calls."""
    return on_index(fn, launch_index(device))


def on_index(fn, index):
    """``fn`` itself for ``index`` None, else ``fn`` called with CUDA device ``index`` current."""
    if index is None:
        return fn
    import functools

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        with _cuda_device(index):
            return fn(*args, **kwargs)

    return guarded
