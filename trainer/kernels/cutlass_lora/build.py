"""Build and load the CUTLASS LoRA-GEMM extension, on demand (nothing here runs at import).

Sources: this folder's lora_mainloop.hpp, lora_gemm.cuh, lora_gemm_args.h and bindings.cpp, plus one
generated translation unit per (operand layout, kernel configuration), ``lora_gemm_<layout>_c<i>.cu``
(two lines each, written into the build folder), so ninja compiles the eight CUTLASS kernels in
parallel. CUTLASS's headers come from the ``nvidia-cutlass`` package (``cutlass_library/source``:
``pip install --no-deps nvidia-cutlass==4.2.0.0`` on a GPU machine; nothing on the CPU path needs it);
nvcc from CUDA_HOME (torch's lookup).

The build runs through ``torch.utils.cpp_extension.load`` with ``-gencode arch=compute_90a,code=sm_90a``
only (WGMMA and TMA need sm_90a; passing an arch flag stops torch from adding its own list). It
needs no GPU: ``python -m trainer.kernels.cutlass_lora.build`` compiles on any machine with nvcc and
prints the compile time and ptxas's register / spill report (the CPU machine's compile-only proof).
The build folder is ``<repo>/.cache/cutlass_lora/<torch version>`` (ignored by git; the device
machine keeps ignored build outputs between calls) or ``$LORAFLEET_CUTLASS_BUILD_DIR``.
"""

from __future__ import annotations

import argparse
import functools
import glob
import hashlib
import importlib.util
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
NAME = "lorafleet_cutlass_lora"
LAYOUTS = ("nk", "kn")  # forward (w [N, K], LoRA B [G, N, R]) and input gradient (w [K, N], LoRA A [G, R, N])
CONFIG_COUNT = 4  # lora_gemm_args.h kConfigs (kernels.CONFIGS mirrors it; checked when loaded)
HEADERS = ("lora_mainloop.hpp", "lora_gemm.cuh", "lora_gemm_args.h")

NVCC_FLAGS = [
    "-gencode=arch=compute_90a,code=sm_90a",
    "-O3", "-DNDEBUG",  # the C++ standard is torch's (C++20 for torch >= 2.12)
    "--expt-relaxed-constexpr",
    "-Xptxas=-v",  # registers and spills per kernel, in the build log
    # torch's defaults switch off the half / bfloat16 operators CUTLASS's numeric types use
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_BFLOAT162_OPERATORS__",
    "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
]


def cutlass_include_dirs() -> list[Path]:
    """CUTLASS's include folders from the installed ``nvidia-cutlass`` package."""
    spec = importlib.util.find_spec("cutlass_library")  # finds the package without importing it
    if spec is None or spec.origin is None:
        raise RuntimeError("the CUTLASS headers are missing: install the nvidia-cutlass package "
                           "(pip install --no-deps nvidia-cutlass==4.2.0.0: its headers only)")
    source = Path(spec.origin).parent / "source"
    dirs = [source / "include", source / "tools" / "util" / "include"]
    missing = [d for d in dirs if not d.is_dir()]
    if missing:
        raise RuntimeError(f"nvidia-cutlass is installed without its C++ headers ({missing[0]} is missing)")
    return dirs


def build_dir() -> Path:
    explicit = os.environ.get("LORAFLEET_CUTLASS_BUILD_DIR")
    if explicit:
        return Path(explicit)
    import torch

    tag = re.sub(r"[^A-Za-z0-9_.]", "_", torch.__version__)
    return HERE.parents[2] / ".cache" / "cutlass_lora" / tag


def kernel_units(folder: Path) -> list[Path]:
    """One translation unit per (layout, config), written into ``folder`` (rewritten only when its
    text changed, so ninja's timestamps hold)."""
    folder.mkdir(parents=True, exist_ok=True)
    units = []
    for layout in LAYOUTS:
        for config in range(CONFIG_COUNT):
            path = folder / f"lora_gemm_{layout}_c{config}.cu"
            text = f'#include "lora_gemm.cuh"\nLORAFLEET_INSTANTIATE({layout}, {config})\n'
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
            units.append(path)
    return units


def cuda_home() -> str:
    """The CUDA toolkit to build with: $CUDA_HOME, else /usr/local/cuda or the newest /usr/local/cuda-*
    holding nvcc and the runtime headers (an ``nvcc`` on PATH may be a wrapper script, from which
    torch's own guess, its parent's parent, is wrong)."""
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [explicit] if explicit else ["/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"), reverse=True)]
    for home in candidates:
        if Path(home, "bin", "nvcc").exists() and Path(home, "include", "cuda_runtime_api.h").exists():
            return home
    raise RuntimeError(f"no CUDA toolkit with nvcc and cuda_runtime_api.h among {candidates}: set CUDA_HOME")


def _load(verbose: bool):  # noqa: ANN202 - the extension module
    home = cuda_home()
    if "torch.utils.cpp_extension" not in sys.modules:
        os.environ["CUDA_HOME"] = home  # torch reads it once, when cpp_extension is first imported
    from torch.utils import cpp_extension

    if not cpp_extension.CUDA_HOME or not Path(cpp_extension.CUDA_HOME, "include", "cuda_runtime_api.h").exists():
        raise RuntimeError(f"torch.utils.cpp_extension found CUDA at {cpp_extension.CUDA_HOME!r}, which lacks the "
                           f"runtime headers; start Python with CUDA_HOME={home}")

    folder = build_dir()
    sources = [str(HERE / "bindings.cpp"), *map(str, kernel_units(folder / "src"))]
    include = [str(HERE), *map(str, cutlass_include_dirs())]
    return cpp_extension.load(
        name=NAME, sources=sources, extra_include_paths=include, extra_cflags=["-O3"],
        extra_cuda_cflags=[*NVCC_FLAGS, f"-DLORAFLEET_HEADERS_SHA={headers_digest()}"],
        build_directory=str(folder), verbose=verbose,
    )


def headers_digest() -> str:
    """A digest of the headers' text. torch's load() rebuilds when a source file or a flag changes,
    and the headers are neither: their digest, passed as a define, makes a header edit a rebuild."""
    digest = hashlib.sha256()
    for name in HEADERS:
        digest.update((HERE / name).read_bytes())
    return digest.hexdigest()[:16]


@functools.cache
def load(verbose: bool = False):  # noqa: ANN201
    """The extension module (built the first time, minutes; later loads read the build folder)."""
    return _load(verbose)


def parse_ptxas(log: str) -> list[dict]:
    """Per kernel entry: registers, spill bytes, the config it belongs to (from the mangled name's
    tile shape and cluster), from ptxas -v lines."""
    out, current = [], None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
        if m:
            current = {"kernel": m.group(1), "arch": m.group(2)}
            out.append(current)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current["spill_store_bytes"], current["spill_load_bytes"] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Compile the CUTLASS LoRA-GEMM extension (no GPU needed) and report.")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compiles (MAX_JOBS; default: ninja's)")
    args = ap.parse_args(argv)
    if args.jobs:
        os.environ["MAX_JOBS"] = str(args.jobs)
    start = time.monotonic()
    module = _load(verbose=True)
    print(f"# built {NAME} in {time.monotonic() - start:.1f} s at {build_dir()}")
    for row in module.configs():
        print("# config", row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
