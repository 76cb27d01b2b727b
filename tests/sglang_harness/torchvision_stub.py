"""An import-only stand-in for torchvision in the SGLang test server process.

SGLang 0.5.23 imports torchvision at module level (multimodal helpers), and PyPI's torchvision
does not load beside the CPU torch build. Nothing the test server runs uses vision ops: any call
into the stand-in raises. Installed only by the harness's own processes (server.py, scheduler.py)."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder:
    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        raise RuntimeError("torchvision stand-in: vision ops are not available in the SGLang test server")

    def __getattr__(self, name: str) -> "_Placeholder":
        return _Placeholder()

    def __class_getitem__(cls, item):
        return cls

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision" or fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    if not any(isinstance(finder, _StubFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _StubFinder())
