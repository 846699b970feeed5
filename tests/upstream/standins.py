"""Stand-ins for torchvision and torchaudio, for the upstream suite only.

The registry's torchvision/torchaudio wheels are CUDA builds that fail to import beside the
CPU torch of these machines ("operator torchvision::nms does not exist"). ComfyUI imports them
at module level in files the H3 DiT path never calls into, so the suite gives those imports an
empty module: any attribute is a placeholder that raises if it is ever called, so a case that
did use them would fail loudly rather than pass on a stand-in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

STOOD_IN: list[str] = []  # what this process stood in (the suite reports it)


class _Placeholder:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item):
        return _Placeholder(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a test stand-in: torchvision/torchaudio are not usable here")

    def __mro_entries__(self, bases):  # `class X(torchvision.Something)` at import time
        return (object,)


class _StandInModule(types.ModuleType):
    def __getattr__(self, item):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _importable(name: str) -> bool:
    try:
        __import__(name)
        return True
    except Exception:  # absent, or the CUDA wheel that fails beside a CPU torch
        sys.modules.pop(name, None)
        return False


def install(names=("torchvision", "torchaudio")) -> list[str]:
    """Stand in every one of `names` that cannot be imported for real; returns those."""
    missing = {n for n in names if n not in STOOD_IN and not _importable(n)}
    if missing:
        sys.meta_path.insert(0, _StandInFinder(missing))
        STOOD_IN.extend(sorted(missing))
    return list(STOOD_IN)
