"""A stand-in for torchvision where SGLang's scheduler is imported on a CPU machine: the package
index serves CUDA builds of torchvision only, which fail to load beside a CPU torch, and the
scheduler imports it for multimodal models alone. Every ``torchvision.*`` module and attribute is
a placeholder; calling one raises."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _module(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.__name__}: torchvision is a placeholder in this environment")

    def __mro_entries__(self, bases):
        return (object,)


def _module(name):
    if name not in sys.modules:
        module = _Placeholder(name)
        module.__path__ = []
        sys.modules[name] = module
    return sys.modules[name]


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _module(spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Placeholder
__path__ = []
