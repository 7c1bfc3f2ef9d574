"""vLLM's and SGLang's own SSU Triton kernels, run unchanged on the CPU in Triton's interpreter,
as a second oracle for the engine call forms (docs/spec.md, "Engine call forms").

Each engine's kernel module is read at run time out of its wheel (downloaded with ``pip download
--no-deps``; nothing of it is kept in this repository) and executed as a private module. The few
engine-internal modules it imports are stood in for while it executes: vLLM's platform (neither
CPU nor XPU, so its Triton path stays), logger, environment, custom ops, the real Triton as its
``triton_utils``, its null block id and its ``fast_exp`` (the wheel's own helper module, executed
too); SGLang's PDL query (no PDL on the CPU) and a ``torch`` whose CPU device module has a no-op
``device()`` context (its wrapper enters one). The kernels, their wrappers and heuristics run as
shipped.

Triton 3.9's interpreter refuses a load mask built from a broadcast scalar comparison ("mask has
unsupported dtype"), a line both kernels have; where a one-program probe shows it, masked loads and
stores view their mask as bool (what a GPU does, and what Triton 3.8's interpreter did).
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import logging
import os
import sys
import types
import zipfile
from pathlib import Path
from typing import Optional

VLLM = ("vllm", "0.34.0")
SGLANG = ("sglang", "0.5.23")
VLLM_KERNEL = "vllm/model_executor/layers/mamba/ops/mamba_ssm.py"
VLLM_HELPERS = "vllm/model_executor/layers/mamba/ops/triton_helpers.py"
VLLM_UTILS = "vllm/v1/attention/backends/utils.py"
SGLANG_KERNEL = "sglang/kernels/ops/mamba/triton_ops/mamba_ssm.py"
#: where the wheels are looked for: $SSU_ENGINE_WHEELS, else .engines/ at the repository's root
WHEELS = Path(os.environ.get("SSU_ENGINE_WHEELS", Path(__file__).resolve().parents[1] / ".engines"))
_loaded: dict = {}


def wheel(name: str, version: str) -> Optional[Path]:
    """The engine's wheel in :data:`WHEELS`, or None."""
    found = sorted(WHEELS.glob(f"{name}-{version}-*.whl")) if WHEELS.is_dir() else []
    return found[0] if found else None


def missing(name: str, version: str) -> str:
    return (
        f"{name} {version}'s wheel is not in {WHEELS}: pip download --no-deps {name}=={version} -d {WHEELS} "
        "(or set SSU_ENGINE_WHEELS)"
    )


class _Source:
    """A loader that hands inspect (and so Triton's JIT) the source of a module run from a wheel."""

    def __init__(self, source: str) -> None:
        self.source = source

    def get_source(self, name):
        return self.source


def _run(archive: Path, member: str, name: str):
    """Execute ``member`` of the wheel ``archive`` as the module ``name``."""
    with zipfile.ZipFile(archive) as zf:
        source = zf.read(member).decode()
    filename = f"{archive}/{member}"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__, module.__loader__ = filename, _Source(source)
    module.__package__ = name.rpartition(".")[0]
    sys.modules[name] = module  # Triton's JIT looks the module up
    exec(compile(source, filename, "exec"), module.__dict__)  # noqa: S102 - the engine's own kernel, as shipped
    return module


@contextlib.contextmanager
def _standing_in(modules: dict):
    """``modules`` (and bare parent packages) in sys.modules while the block runs; what was there before comes back."""
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


def _module(name: str, **values):
    module = types.ModuleType(name)
    module.__dict__.update(values)
    return module


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


def _bool_masks() -> None:
    """Masked loads and stores of the interpreter view their mask as bool (once, where needed)."""
    if _loaded.get("masks") is not None:
        return
    _loaded["masks"] = False
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
    _loaded["masks"] = True


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


def vllm_ssu(archive: Path):
    """vLLM's ``selective_state_update`` (its Triton kernel), runnable on the CPU in the interpreter."""
    key = ("vllm", str(archive))
    if key not in _loaded:
        import triton
        import triton.language as tl

        _bool_masks()
        with zipfile.ZipFile(archive) as zf:
            utils = zf.read(VLLM_UTILS).decode()
        null_block = next(
            ast.literal_eval(node.value)
            for node in ast.parse(utils).body
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NULL_BLOCK_ID" for t in node.targets)
        )
        modules = {
            "vllm.envs": _module("vllm.envs", VLLM_TUNED_CONFIG_FOLDER=None),
            "vllm._custom_ops": _module("vllm._custom_ops"),
            "vllm.logger": _module("vllm.logger", init_logger=_Logger),
            "vllm.platforms": _module("vllm.platforms", current_platform=_Platform()),
            "vllm.triton_utils": _module("vllm.triton_utils", HAS_TRITON=True, triton=triton, tl=tl),
            "vllm.utils.platform_utils": _module(
                "vllm.utils.platform_utils", get_device_name_as_file_name=lambda *a, **k: "cpu_interpreter"
            ),
            "vllm.v1.attention.backends.utils": _module("vllm.v1.attention.backends.utils", NULL_BLOCK_ID=null_block),
        }
        with _standing_in(modules):
            helpers = _run(archive, VLLM_HELPERS, "_ssu_engine_oracle.vllm.triton_helpers")
        modules["vllm.model_executor.layers.mamba.ops.triton_helpers"] = helpers
        with _standing_in(modules):
            _loaded[key] = _run(archive, VLLM_KERNEL, "_ssu_engine_oracle.vllm.mamba_ssm").selective_state_update
    return _loaded[key]


class _NoDevice:
    """A no-op ``device(index)`` context."""

    def __init__(self, index=None) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Torch(types.ModuleType):
    """torch, whose CPU device module has a ``device()`` context (a no-op)."""

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)

    @staticmethod
    def get_device_module(device=None):
        import torch

        module = torch.get_device_module(device)
        if module is torch.cpu and not hasattr(module, "device"):
            return _module("torch.cpu", device=_NoDevice)
        return module


def sglang_ssu(archive: Path):
    """SGLang's ``selective_state_update`` (its Triton kernel), runnable on the CPU in the interpreter."""
    key = ("sglang", str(archive))
    if key not in _loaded:
        _bool_masks()
        modules = {"sglang.kernels.jit.utils": _module("sglang.kernels.jit.utils", is_arch_support_pdl=lambda: False)}
        with _standing_in(modules):
            module = _run(archive, SGLANG_KERNEL, "_ssu_engine_oracle.sglang.mamba_ssm")
        module.torch = _Torch("torch")
        _loaded[key] = module.selective_state_update
    return _loaded[key]
