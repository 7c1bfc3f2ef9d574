"""Module paths at ssu's root that name modules now in a package of their job: ``import ssu.records``,
``from ssu.slot_state import versions`` and every other path below give the very module at its
place in its package (one object under two names), imported only when asked for. Code in this
repository uses the package paths; these are for backends and engines written against the root ones.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

#: old module path -> the module's path now
MOVED = {
    "ssu.config": "ssu.plugins.config",
    "ssu.decode": "ssu.cli.decode",
    "ssu.devices": "ssu.contract.devices",
    "ssu.dropin_engines": "ssu.dropin.engines",
    "ssu.dtypes": "ssu.contract.dtypes",
    "ssu.engine_calls": "ssu.runtime.engine_calls",
    "ssu.engine_checks": "ssu.runtime.engine_checks",
    "ssu.engine_harness": "ssu.checking.engine_harness",
    "ssu.errors": "ssu.contract.errors",
    "ssu.faults": "ssu.state.faults",
    "ssu.files": "ssu.measure.files",
    "ssu.firstparty": "ssu.plugins.firstparty",
    "ssu.harness": "ssu.checking.harness",
    "ssu.hookspecs": "ssu.contract.hookspecs",
    "ssu.inputs": "ssu.checking.inputs",
    "ssu.kernel": "ssu.runtime.kernel",
    "ssu.options": "ssu.contract.options",
    "ssu.oracle": "ssu.checking.oracle",
    "ssu.preflight": "ssu.plugins.preflight",
    "ssu.problem": "ssu.contract.problem",
    "ssu.quant": "ssu.state.quant",
    "ssu.records": "ssu.contract.records",
    "ssu.registry": "ssu.plugins.registry",
    "ssu.resolve": "ssu.plugins.resolve",
    "ssu.scaffold": "ssu.cli.scaffold",
    "ssu.shapes": "ssu.integrations.shapes",
    "ssu.signatures": "ssu.runtime.signatures",
    "ssu.slot_kernels": "ssu.state.slot_kernels",
    "ssu.slot_state": "ssu.state.slot_state",
    "ssu.timing": "ssu.measure.timing",
    "ssu.traffic": "ssu.measure.traffic",
    "ssu.validation": "ssu.runtime.validation",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A finder for the old paths of :data:`MOVED`: each one is its new module, not a copy."""

    def find_spec(self, fullname, path=None, target=None):
        """A spec for an old path (None for every other name, which the other finders serve)."""
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        """The module at its new path, imported there if it is not yet."""
        module = importlib.import_module(MOVED[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module) -> None:
        """Nothing to run: give back the module's own spec, which importing it by its old name replaced."""
        module.__spec__ = module.__spec__.loader_state


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())


def moved_attribute(name: str):
    """``ssu.<name>`` for an old module name (``ssu.errors`` after ``import ssu``), else None."""
    old = f"ssu.{name}"
    return importlib.import_module(old) if old in MOVED else None
