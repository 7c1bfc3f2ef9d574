"""Test helpers: fake distributions on disk, a working fake backend module, small problems."""

from __future__ import annotations

import importlib.metadata as metadata
import sys
import textwrap
from pathlib import Path


import ssu
from ssu.plugins.registry import GROUP, Registry


class FakeSite:
    """A directory of fake installed distributions (dist-info metadata + modules).

    ``add(dist, {backend: "module"}, modules={"module": source})`` writes one distribution;
    ``registry(env=...)`` returns a Registry that sees exactly these distributions plus the real
    ssu-core (for ``reference``). Modules become importable through ``sys.path``.
    """

    def __init__(self, root: Path, monkeypatch) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        monkeypatch.syspath_prepend(str(root))
        self._modules: list[str] = []

    def add(
        self,
        dist: str,
        entry_points: dict,
        *,
        version: str = "1.0",
        modules: dict | None = None,
        info_name: str | None = None,
    ) -> None:
        info = self.root / f"{info_name or dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        lines = "\n".join(f"{name} = {value}" for name, value in entry_points.items())
        (info / "entry_points.txt").write_text(f"[{GROUP}]\n{lines}\n")
        for name, source in (modules or {}).items():
            (self.root / f"{name}.py").write_text(textwrap.dedent(source))
            self._modules.append(name)

    def entry_points(self) -> list:
        eps = [ep for d in metadata.distributions(path=[str(self.root)]) for ep in d.entry_points if ep.group == GROUP]
        core = [ep for ep in metadata.entry_points(group=GROUP) if ep.name == "reference"]
        return core + eps

    def registry(self, env: dict | None = None) -> Registry:
        return Registry(entry_points=self.entry_points(), env=env or {})

    def cleanup(self) -> None:
        for name in self._modules:
            sys.modules.pop(name, None)


#: a working CPU backend module for fake distributions: delegates everything to the reference
GOOD_BACKEND = """
import ssu
from ssu.reference.math import make_step

NAME = "{name}"
API = "{api}"
PRIORITY = {priority}
AVAILABLE = {available}

@ssu.hookimpl
def ssu_backend():
    return ssu.BackendSpec(name=NAME, api_version=API, factory=make_step, priority=PRIORITY,
                           options_class=globals().get("OPTIONS"),
                           capabilities=ssu.Capabilities(devices={{"cpu"}}, max_tokens_per_step=4, speculative=True),
                           description="fake backend " + NAME)

@ssu.hookimpl
def ssu_probe(device):
    return ssu.AVAILABLE if AVAILABLE else ssu.Availability(False, "no frobnicator here", "install a frobnicator")

from ssu.state.slot_state import ssu_allocate_state, ssu_commit, ssu_read_state, ssu_write_state
"""


def good_backend(name: str, *, api: str = ssu.PLUGIN_API_VERSION, priority: int = 0, available: bool = True) -> str:
    return GOOD_BACKEND.format(name=name, api=api, priority=priority, available=available)


def small_problem(**overrides) -> ssu.Problem:
    fields = dict(
        nheads=4, headdim=8, dstate=16, ngroups=2, state_dtype="fp32", input_dtype="fp32", num_slots=10, max_batch=4
    )
    fields.update(overrides)
    return ssu.Problem(**fields)


def gpu_only_backend():
    """An in-process backend (``ssu.register_backend``) named ``gpu-only`` that adopts engine caches
    and serves CUDA devices only: every CPU problem is refused."""
    import types

    from ssu.reference.math import make_step
    from ssu.state.slot_state import ssu_adopt_state, ssu_allocate_state, ssu_commit, ssu_read_state, ssu_write_state

    def ssu_backend():
        return ssu.BackendSpec(name="gpu-only", api_version=ssu.PLUGIN_API_VERSION, factory=make_step,
                               capabilities=ssu.Capabilities(devices={"cuda"}, adopt_state=True))  # fmt: skip

    module = types.ModuleType("gpu_only_backend")
    module.ssu_backend = ssu.hookimpl(ssu_backend)
    for hook in (ssu_adopt_state, ssu_allocate_state, ssu_commit, ssu_read_state, ssu_write_state):
        setattr(module, hook.__name__, hook)
    return module


def bounded_backend(max_batch: int = 4, max_tokens: int = 2):
    """An in-process backend (``ssu.register_backend``) named ``bounded``: the reference's kernels
    and engine call forms on the CPU, refusing every problem of more than ``max_batch`` sequences
    or ``max_tokens`` tokens a sequence (its ``ssu_supports``), so that a cache it serves at small
    sizes meets a problem no backend serves when the batch or T grows."""
    import types

    import attrs

    from ssu import reference

    def ssu_backend():
        spec = reference.ssu_backend()
        return attrs.evolve(
            spec, name="bounded", priority=0, capabilities=attrs.evolve(spec.capabilities, devices={"cpu"})
        )

    def ssu_supports(problem, options):
        if problem.max_batch > max_batch or problem.tokens_per_step > max_tokens:
            return ssu.Verdict.reject(f"bounded serves at most {max_batch} sequences of {max_tokens} tokens")
        return ssu.ACCEPT

    module = types.ModuleType("bounded_backend")
    module.ssu_backend = ssu.hookimpl(ssu_backend)
    module.ssu_supports = ssu.hookimpl(ssu_supports)
    for name in ("ssu_engine_call", "ssu_adopt_state", "ssu_allocate_state", "ssu_commit", "ssu_read_state",
                 "ssu_write_state"):  # fmt: skip
        setattr(module, name, getattr(reference, name))
    return module


def beside_backend():
    """An in-process backend (``ssu.register_backend``) named ``beside``: the reference's kernels on
    the CPU, first under ``"auto"`` (priority 10), that implements ``ssu_sync_state``, as a backend
    keeping state beside an adopted cache does (triton-replay): the drop-in call cannot use it."""
    import types

    import attrs

    from ssu import reference

    def ssu_backend():
        spec = reference.ssu_backend()
        caps = attrs.evolve(spec.capabilities, devices={"cpu"})
        return attrs.evolve(spec, name="beside", priority=10, capabilities=caps)

    def ssu_sync_state(ctx, state, slots):
        return None

    module = types.ModuleType("beside_backend")
    module.ssu_backend = ssu.hookimpl(ssu_backend)
    module.ssu_sync_state = ssu.hookimpl(ssu_sync_state)
    for name in ("ssu_engine_call", "ssu_adopt_state", "ssu_allocate_state", "ssu_commit", "ssu_read_state",
                 "ssu_write_state"):  # fmt: skip
        setattr(module, name, getattr(reference, name))
    return module
