"""Megatron-core / Megatron-Bridge adjustments for machines without CUDA (and without TE).

A user without a GPU runs the real stack: the same Megatron-Bridge conversion,
the same Megatron-core GPT model, on torch CPU with a gloo process group. The
stock packages assume CUDA in a handful of places; every adjustment lives here,
in one place, each with the reason it exists (measured facts: shared/FINDINGS.md).

Two switches, decided once per process:

* ``cuda_available()`` false -> the CPU adjustments (:func:`apply_cpu_compat`):
  1. ``torch.cuda.current_device`` answers ``"cpu"``: megatron-core hard-codes
     ``device=torch.cuda.current_device()`` when it allocates (rotary embedding
     frequencies, the attention memory buffer, ...). With the redirect those
     allocations land on the CPU; nothing else about torch changes.
  2. ``flash_mla`` is made to raise ImportError: sglang ships it in the same
     environment, its import raises *OSError* without libcuda, and
     megatron-core's attention module catches only ImportError, so
     ``import megatron.core.transformer.attention`` would crash.
  3. The process group backend is gloo (:func:`process_group_backend`), since
     NCCL needs GPUs.
  4. :func:`seed_model_parallel_rng` uses the *inference* RNG tracker: the CUDA
     RNG tracker forks ``torch.cuda`` generator states, which do not exist
     here; the inference tracker is a no-op fork, so dropout (off anyway for
     LoRA training) would draw from the CPU generator.
  5. Activation recomputation: megatron-core's checkpoint functions save and
     restore the *CUDA* RNG state around the recomputed forward
     (``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``),
     which fails without a CUDA device. There is no CUDA generator to keep in step
     here (dropout is off and would draw from the CPU generator, whose state the
     same functions save separately), so the getter answers an empty tensor and
     the setter does nothing (:func:`_patch_rng_for_recompute`).
  5b. Numerics: fp32 params by default (``dtype="auto"`` resolves to float32
     without CUDA, trainer/base/base_model.py; bf16 stays selectable for tests) and
     the CUDA/JIT fusions off (``bias_activation_fusion`` etc., see
     :func:`cpu_provider_overrides`). ``TORCHDYNAMO_DISABLE=1`` is set as a
     default: megatron-core decorates a few functions with torch.compile, which
     costs 3-21 s on a CPU for a 10 ms step.

* ``transformer_engine`` not importable (true on this CPU machine *and* on the
  GPU machine we test on) -> :func:`import_megatron_bridge` makes Bridge
  importable without TE:
  6. Megatron-Bridge 0.6.2's ``peft/lora_layers.py`` does
     ``import transformer_engine.pytorch as te`` unconditionally, and
     ``import megatron.bridge`` reaches it through its model registry. We serve
     that one module a stand-in ``transformer_engine`` *only while it
     executes* (a meta-path hook scoped to that module); the stand-in is
     removed right after, so every other ``import transformer_engine`` in the
     process still fails and megatron-core keeps choosing its local (non-TE)
     code paths.
  7. ``megatron.bridge.peft.utils.HAVE_TE`` is forced False: it is computed from
     ``megatron.core.extensions.transformer_engine``, which defines its wrapper
     classes even without TE, so it reads True and Bridge would then treat
     local linears as TE ones.

All functions are idempotent and safe to call from every entry point.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from functools import cache
from typing import Any

import torch

_STUB_TARGET = "megatron.bridge.peft.lora_layers"


@cache
def cuda_available() -> bool:
    """Whether this process can use a CUDA device (decided once, before any redirect)."""
    return torch.cuda.is_available()


@cache
def transformer_engine_available() -> bool:
    """Whether the real TransformerEngine imports (without leaving a stand-in behind)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # a broken TE install is as good as none
        return False
    return True


@cache
def triton_available() -> bool:
    """Whether triton imports (the trainer's Triton kernels: triton_adamw, triton_lora)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def process_group_backend() -> str:
    """nccl with CUDA, gloo without (adjustment 3)."""
    return "nccl" if cuda_available() else "gloo"


def apply_cpu_compat() -> None:
    """Apply adjustments 1, 2 and 5 when no CUDA device is present; no-op otherwise."""
    if cuda_available():
        return
    # Decide before the redirect: cuda_available() is cached above.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    # 1. megatron-core allocates on torch.cuda.current_device().
    if getattr(torch.cuda.current_device, "__lorafleet_cpu__", False) is False:

        def _current_device_is_cpu() -> str:
            return "cpu"

        _current_device_is_cpu.__lorafleet_cpu__ = True  # type: ignore[attr-defined]
        torch.cuda.current_device = _current_device_is_cpu  # type: ignore[assignment]
    # 2. flash_mla raises OSError (not ImportError) without libcuda; a None entry
    #    in sys.modules makes `import flash_mla` raise ImportError instead.
    if "flash_mla" not in sys.modules or sys.modules["flash_mla"] is None:
        sys.modules["flash_mla"] = None  # type: ignore[assignment]
    _patch_rng_for_recompute()


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _set_no_cuda_rng_state(*args: Any, **kwargs: Any) -> None:
    return None


def _patch_rng_for_recompute() -> None:
    """Adjustment 5 (CPU only): no CUDA RNG state to save/restore around recomputation."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = _no_cuda_rng_state
    random._set_cuda_rng_state = _set_no_cuda_rng_state


def cpu_provider_overrides() -> dict[str, Any]:
    """Provider fields that must change on a CPU-only machine (adjustment 5b)."""
    if cuda_available():
        return {}
    return {
        "bias_activation_fusion": False,
        "masked_softmax_fusion": False,
        "gradient_accumulation_fusion": False,
        "cross_entropy_loss_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
    }


def seed_model_parallel_rng(seed: int) -> None:
    """Seed megatron-core's model-parallel RNG tracker (adjustment 4 on CPU)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not cuda_available(), force_reset_rng=True
    )


# --- adjustments 6 and 7: Megatron-Bridge without TransformerEngine ---------------------


class _Absent:
    """Stands for a TransformerEngine class in the scoped stand-in; never instantiable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "TransformerEngine is not installed; this Megatron-Bridge code path needs it"
        )


class _AbsentTEModule(types.ModuleType):
    """Any attribute is a class nobody can instantiate, or a nested stand-in module.

    Lower-case names (``te.ops``) are sub-namespaces; capitalised ones are classes
    (used by lora_layers only in annotations and isinstance checks)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].islower():
            value: Any = _AbsentTEModule(f"{self.__name__}.{name}")
        else:
            value = type(name, (_Absent,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _ScopedTEStandIn(importlib.abc.Loader):
    """Executes lora_layers with a stand-in TE visible, then removes the stand-in."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # Import lora_layers' other dependencies first, with no stand-in visible, so
        # none of them can see a fake TE and pick a TE code path.
        for dep in (
            "megatron.core.transformer.moe.moe_utils",
            "megatron.bridge.peft.adapter_wrapper",
            "megatron.bridge.peft.lora_merge",
        ):
            importlib.import_module(dep)
        te = _AbsentTEModule("transformer_engine")
        saved = {k: sys.modules.get(k) for k in ("transformer_engine", "transformer_engine.pytorch")}
        sys.modules["transformer_engine"] = te
        sys.modules["transformer_engine.pytorch"] = te.pytorch
        try:
            self._inner.exec_module(module)
        finally:
            for key, value in saved.items():
                if value is None:
                    sys.modules.pop(key, None)
                else:
                    sys.modules[key] = value


class _LoraLayersFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # noqa: ANN001 - importlib protocol
        if fullname != _STUB_TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _ScopedTEStandIn(spec.loader)
        return spec


def import_megatron_bridge() -> types.ModuleType:
    """Import ``megatron.bridge`` with every adjustment this machine needs; return it."""
    apply_cpu_compat()
    if not transformer_engine_available() and _STUB_TARGET not in sys.modules:
        if not any(isinstance(f, _LoraLayersFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _LoraLayersFinder())
    bridge = importlib.import_module("megatron.bridge")
    if not transformer_engine_available():
        peft_utils = importlib.import_module("megatron.bridge.peft.utils")
        peft_utils.HAVE_TE = False  # adjustment 7
    return bridge
