"""Stand-in for the CUDA-only ``sgl_kernel`` package, for SGLang on a CPU-only machine.

Why it exists: ``pip install sglang`` pulls ``sglang-kernel``, a CUDA-only wheel
whose import fails without libcuda (``ModuleNotFoundError: common_ops``). SGLang
imports ``sgl_kernel`` (and submodules such as ``sgl_kernel.kvcacheio``) at module
import time on many paths, including ones the CPU engine never calls. On a CPU
without AMX, SGLang's CPU engine computes attention, norms, activations and rope
in plain torch, so no kernel from this package is ever *called*.

This stand-in makes every import succeed and makes every use fail loudly: any
attribute is a placeholder whose call raises ``NotImplementedError`` naming the
kernel. ``rollout.engines.sglang_cpu`` puts this folder on the server's import path only
when the real package cannot be imported, and only for the server process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

IS_LORAFLEET_STAND_IN = True
__version__ = "0.0.0+lorafleet-cpu-stand-in"


class _Unavailable:
    """A kernel that does not exist on this machine; attribute access yields more of the same."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{self._name} is a CUDA kernel; lorafleet's CPU stand-in for sgl_kernel has no "
            "implementation (SGLang's CPU engine should not call it: check the server flags)"
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<unavailable {self._name}>"


def _module_getattr(module_name: str):
    def __getattr__(attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{module_name}.{attr}")

    return __getattr__


class _StubSubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers ``import sgl_kernel.<anything>`` with a stub module of the same kind."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []  # a package, so deeper submodules resolve too
        mod.__getattr__ = _module_getattr(spec.name)
        return mod

    def exec_module(self, module):
        return None


if not any(isinstance(f, _StubSubmoduleFinder) for f in sys.meta_path):
    sys.meta_path.append(_StubSubmoduleFinder())

__getattr__ = _module_getattr(__name__)
