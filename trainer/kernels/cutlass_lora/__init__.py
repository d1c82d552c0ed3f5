"""LoRA in the base GEMM: a CUTLASS 3.x Hopper kernel (C++ through nvcc, sm_90a) whose mainloop runs a
LoRA linear's expand as extra K blocks of the base GEMM (forward: x W^T + h_g B_g^T; input gradient:
g W + gh_g A_g), for per-segment adapters. lora_mainloop.hpp / lora_gemm.cuh / bindings.cpp are the
kernel; build.py builds it as a torch extension on first use (nothing is compiled or imported on a
machine without CUDA unless asked); plan.py the row-tile table and the kernel's contract in torch;
kernels.py the calls and what the kernel can take; dispatch.py which path a call takes
(``lora_gemm``: library, cutlass, or auto = measured on first use).

May import: trainer.platform.
"""
