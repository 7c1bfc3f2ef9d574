"""The SSU kernels vLLM and SGLang run today, for ``ssu bench --engine`` (and the tests' second
oracle of the engine call forms).

An engine's kernel is imported from the installed engine where it is installed. Where it is not
(the engines pin their own torch, so a benchmark machine may not have them), it is read out of the
engine's wheel (``pip download --no-deps vllm==0.34.0``), or out of a folder holding the same paths
(``scripts/engine-kernels`` extracts them, small enough to carry to a GPU machine), and executed
as a private module, the kernel, its wrapper, heuristics and tuned launch configs as shipped. The
few engine-internal modules it imports are stood in for while it executes:

- vLLM's ``mamba_ssm.py``: its logger, environment (``VLLM_TUNED_CONFIG_FOLDER`` naming the tuned
  configs of ``configs/selective_state_update/`` from the same wheel), custom ops (unused by the
  SSU), a platform that is neither CPU nor XPU (so that its Triton path stays), the real Triton as
  ``triton_utils``, its device name as vLLM files it (``torch.cuda.get_device_name``, spaces made
  underscores: ``NVIDIA_H100_80GB_HBM3``, which the tuned configs are keyed by), its null block id
  (read from the wheel's ``v1/attention/backends/utils.py``) and ``triton_helpers.py`` (the
  wheel's own, executed too);
- SGLang's ``mamba_ssm.py``: its PDL query ``is_arch_support_pdl`` (true from compute capability
  9, Hopper, as SGLang's own; false on the CPU).

Nothing of an engine's code is kept in this repository: it is read where it runs.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import linecache
import logging
import os
import re
import sys
import tempfile
import types
import zipfile
from pathlib import Path
from typing import Callable, Optional

import attrs

#: what each engine's kernel is: its distribution, the version the project measures and tests,
#: the module its mixers call, and the files it reads out of the wheel
ENGINES = {
    "vllm": dict(
        distribution="vllm",
        version="0.34.0",
        module="vllm.model_executor.layers.mamba.ops.mamba_ssm",
        kernel="vllm/model_executor/layers/mamba/ops/mamba_ssm.py",
        helpers="vllm/model_executor/layers/mamba/ops/triton_helpers.py",
        utils="vllm/v1/attention/backends/utils.py",
        configs="vllm/model_executor/layers/mamba/ops/configs/selective_state_update/",
    ),
    "sglang": dict(
        distribution="sglang",
        version="0.5.23",
        module="sglang.kernels.ops.mamba.triton_ops.mamba_ssm",
        kernel="sglang/kernels/ops/mamba/triton_ops/mamba_ssm.py",
    ),
}


class EngineKernelError(Exception):
    """An engine's kernel cannot be had here; the message says what to install or download."""


@attrs.frozen
class EngineKernel:
    """An engine's own ``selective_state_update``, with where it came from."""

    engine: str
    version: str
    #: how it was loaded: ``installed`` or ``wheel <path>`` / ``folder <path>``
    loaded: str
    call: Callable = attrs.field(repr=False)


def files_of(engine: str) -> tuple:
    """The paths (and folder prefixes) of ``engine``'s wheel that its kernel needs."""
    spec = ENGINES[engine]
    return tuple(spec[key] for key in ("kernel", "helpers", "utils", "configs") if key in spec)


def load(engine: str, source: Optional[str] = None, *, device_name: Optional[Callable] = None) -> EngineKernel:
    """``engine``'s kernel: from the installed engine (``source`` None), else from ``source``, the
    engine's wheel or a folder of its files. ``device_name()`` names the device for vLLM's tuned
    configs (default: the current CUDA device's name)."""
    if engine not in ENGINES:
        raise EngineKernelError(f"unknown engine {engine!r}; ssu knows {', '.join(ENGINES)}")
    spec = ENGINES[engine]
    if source is None:
        try:
            module = importlib.import_module(spec["module"])
        except ImportError as exc:
            raise EngineKernelError(
                f"{engine} is not importable here ({exc}): pip install {spec['distribution']}=={spec['version']}, or "
                f"pass --engine-wheel with its wheel (pip download --no-deps {spec['distribution']}=={spec['version']})"
            ) from None
        from importlib.metadata import version

        return EngineKernel(engine, version(spec["distribution"]), "installed", module.selective_state_update)
    files = _Files(Path(source))
    if os.environ.get("TRITON_INTERPRET") == "1":
        interpreter_masks()
    if engine == "vllm":
        call = _vllm(files, device_name or _cuda_device_name)
    else:
        call = _sglang(files)
    return EngineKernel(engine, files.version(spec["distribution"]), f"{files.kind} {source}", call)


class _Files:
    """The files of an engine's wheel, or of a folder holding the same paths."""

    def __init__(self, path: Path) -> None:
        if not path.exists():
            raise EngineKernelError(f"{path}: no such wheel or folder")
        self.path = path
        self.kind = "folder" if path.is_dir() else "wheel"

    def read(self, member: str) -> str:
        try:
            if self.kind == "folder":
                return (self.path / member).read_text()
            with zipfile.ZipFile(self.path) as zf:
                return zf.read(member).decode()
        except (OSError, KeyError, zipfile.BadZipFile) as exc:
            raise EngineKernelError(f"{self.path}: cannot read {member} ({exc})") from None

    def names(self, prefix: str) -> list:
        if self.kind == "folder":
            return [str(p.relative_to(self.path)) for p in sorted((self.path / prefix).glob("*"))]
        with zipfile.ZipFile(self.path) as zf:
            return [n for n in zf.namelist() if n.startswith(prefix)]

    def version(self, distribution: str) -> str:
        found = re.search(rf"{distribution}-([^-]+)-", self.path.name)
        if found:
            return found.group(1)
        stamp = self.path / f"{distribution}.version"
        return stamp.read_text().strip() if self.kind == "folder" and stamp.exists() else "unknown"


def run(files, member: str, name: str) -> types.ModuleType:
    """Execute ``member`` of ``files`` (a wheel path, or :class:`_Files`) as the module ``name``;
    Triton's JIT finds its source through the module's loader."""
    files = files if isinstance(files, _Files) else _Files(Path(files))
    source = files.read(member)
    filename = f"{files.path}/{member}"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__, module.__loader__ = filename, _Source(source)
    module.__package__ = name.rpartition(".")[0]
    sys.modules[name] = module  # Triton's JIT looks the module up
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - the engine's own kernel, as shipped
    return module


class _Source:
    """A loader that hands inspect (and so Triton's JIT) the source of a module run from a wheel."""

    def __init__(self, source: str) -> None:
        self.source = source

    def get_source(self, name):
        return self.source


@contextlib.contextmanager
def standing_in(modules: dict):
    """``modules`` (and bare parent packages) in sys.modules while the block runs; what was there
    before comes back."""
    wanted = dict(modules)
    for name in list(wanted):
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent not in wanted:
                wanted[parent] = types.ModuleType(parent)
                wanted[parent].__path__ = []
    for name, module in wanted.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(wanted[parent], child, module)
    saved = {name: sys.modules.get(name) for name in wanted}
    sys.modules.update(wanted)
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def module(name: str, **values) -> types.ModuleType:
    """A module named ``name`` holding ``values``."""
    made = types.ModuleType(name)
    made.__dict__.update(values)
    return made


class _Logger(logging.LoggerAdapter):
    """vLLM's logger with its ``*_once`` methods."""

    def __init__(self, name) -> None:
        super().__init__(logging.getLogger(name), {})

    def debug_once(self, msg, *args, **kwargs):
        self.debug(msg, *args)

    def info_once(self, msg, *args, **kwargs):
        self.info(msg, *args)

    def warning_once(self, msg, *args, **kwargs):
        self.warning(msg, *args)


class _Platform:
    """A platform that is neither CPU nor XPU: vLLM keeps its Triton kernel."""

    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda *a, **k: False
        raise AttributeError(name)


def _cuda_device_name() -> str:
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return re.sub(r"[\s/]+", "_", name)


def _vllm(files: _Files, device_name: Callable) -> Callable:
    """vLLM's ``selective_state_update`` out of ``files``, its tuned configs with it."""
    import triton
    import triton.language as tl

    spec = ENGINES["vllm"]
    utils = files.read(spec["utils"])
    null_block = next(
        ast.literal_eval(node.value)
        for node in ast.parse(utils).body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NULL_BLOCK_ID" for t in node.targets)
    )
    configs = Path(tempfile.mkdtemp(prefix="ssu-vllm-configs-"))
    for name in files.names(spec["configs"]):
        if name.endswith(".json"):
            (configs / Path(name).name).write_text(files.read(name))
    modules = {
        "vllm.envs": module("vllm.envs", VLLM_TUNED_CONFIG_FOLDER=str(configs)),
        "vllm._custom_ops": module("vllm._custom_ops"),
        "vllm.logger": module("vllm.logger", init_logger=_Logger),
        "vllm.platforms": module("vllm.platforms", current_platform=_Platform()),
        "vllm.triton_utils": module("vllm.triton_utils", HAS_TRITON=True, triton=triton, tl=tl),
        "vllm.utils.platform_utils": module(
            "vllm.utils.platform_utils", get_device_name_as_file_name=lambda *a, **k: device_name()
        ),
        "vllm.v1.attention.backends.utils": module("vllm.v1.attention.backends.utils", NULL_BLOCK_ID=null_block),
    }
    with standing_in(modules):
        helpers = run(files, spec["helpers"], "_ssu_engine.vllm.triton_helpers")
    modules["vllm.model_executor.layers.mamba.ops.triton_helpers"] = helpers
    with standing_in(modules):
        return run(files, spec["kernel"], "_ssu_engine.vllm.mamba_ssm").selective_state_update


def _pdl() -> bool:
    """SGLang's rule for launching with programmatic dependent launch: Hopper (compute capability 9)
    and later."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _sglang(files: _Files, pdl: Callable = _pdl) -> Callable:
    """SGLang's ``selective_state_update`` out of ``files``."""
    modules = {"sglang.kernels.jit.utils": module("sglang.kernels.jit.utils", is_arch_support_pdl=pdl)}
    with standing_in(modules):
        loaded = run(files, ENGINES["sglang"]["kernel"], "_ssu_engine.sglang.mamba_ssm")
    loaded.torch = _Torch("torch")  # its wrapper enters the device's context, which the CPU lacks
    return loaded.selective_state_update


class _NoDevice:
    """A no-op ``device(index)`` context."""

    def __init__(self, index=None) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Torch(types.ModuleType):
    """torch, whose CPU device module has a ``device()`` context (a no-op), as CUDA's has."""

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    @staticmethod
    def get_device_module(device=None):
        import torch

        found = torch.get_device_module(device)
        if found is torch.cpu and not hasattr(found, "device"):
            return module("torch.cpu", device=_NoDevice)
        return found


def interpreter_masks() -> None:
    """Under Triton's interpreter, masked loads and stores view their mask as bool, where this
    Triton's interpreter refuses a mask made of a broadcast scalar comparison ("mask has
    unsupported dtype"; Triton 3.9), a line both engines' kernels have: what a GPU does, and what
    Triton 3.8's interpreter did. Once per process; nothing where the interpreter takes them."""
    if _patched or os.environ.get("TRITON_INTERPRET") != "1":
        return
    _patched.append(True)
    if not _mask_needs_bool():
        return
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder

    def boolean(mask):
        return mask if mask is None or mask.data.dtype == np.bool_ else type(mask)(mask.data != 0, mask.dtype)

    load, store = InterpreterBuilder.create_masked_load, InterpreterBuilder.create_masked_store
    InterpreterBuilder.create_masked_load = lambda self, ptrs, mask, *rest: load(self, ptrs, boolean(mask), *rest)
    InterpreterBuilder.create_masked_store = lambda self, ptrs, v, mask, *rest: store(
        self, ptrs, v, boolean(mask), *rest
    )


_patched: list = []


def _mask_needs_bool() -> bool:
    """Whether this Triton's interpreter refuses a mask made of a broadcast scalar comparison."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def probe(src, ids, skip, dst, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        keep = offs < BLOCK
        keep &= tl.load(ids) != skip
        tl.store(dst + offs, tl.load(src + offs, mask=keep, other=0.0), mask=keep)

    try:
        probe[(1,)](torch.arange(4.0), torch.ones(1, dtype=torch.int32), 0, torch.zeros(4), BLOCK=4)
    except Exception as exc:
        if "mask has unsupported dtype" in str(exc):
            return True
        raise
    return False


def extract(engine: str, wheel: str, folder: str) -> list:
    """Copy the files ``engine``'s kernel needs out of its wheel into ``folder`` (with a
    ``<distribution>.version`` file): what a GPU machine without the engine loads it from. Returns
    the paths written."""
    files = _Files(Path(wheel))
    out = Path(folder)
    written = []
    for path in files_of(engine):
        for name in files.names(path) if path.endswith("/") else [path]:
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(files.read(name))
            written.append(str(target))
    distribution = ENGINES[engine]["distribution"]
    (out / f"{distribution}.version").write_text(files.version(distribution) + "\n")
    return written
