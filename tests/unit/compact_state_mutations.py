"""Plant bugs in the compact optimizer state (bf16 moments, stochastic rounding) one at a time; a
test must fail for each (the runner of tests/unit/expert_kernel_mutations.py; Triton's interpreter
on the CPU; the persistence plants need the tiny trainer, about 20 s each).

    python -m tests.unit.compact_state_mutations                 # every mutation (a few minutes)
    python -m tests.unit.compact_state_mutations key_by_slot     # one
"""

from __future__ import annotations

import sys

from tests.unit.expert_kernel_mutations import main

KERNEL = "trainer/kernels/triton_adamw.py"
OPS = "trainer/optim/per_slot_optim.py"
ROUNDING = "trainer/optim/compact_state.py"
STEPS = "trainer/optim/slot_steps.py"
BUFFERS = "trainer/lora/slot_buffers.py"
CHECKPOINT = "trainer/swap/slot_checkpoint.py"
TESTS = ["tests/unit/test_compact_adamw.py", "tests/unit/test_step_overlap.py",
         "tests/integration/test_compact_state_trainer.py"]

MUTATIONS = {  # name: (file, exact text, replacement, what the bug is)
    "store_before_update": (
        OPS, "    _adamw_ops(p, g, m, v, cols, _column_view(param))\n    compact_state.store_moments(m, v, mv[:, :width], mv[:, width:], list(cols.noise_keys))\n",
        "    compact_state.store_moments(m, v, mv[:, :width], mv[:, width:], list(cols.noise_keys))\n    _adamw_ops(p, g, m, v, cols, _column_view(param))\n",
        "torch ops: the moments rounded and stored before the moment update (the update is lost)"),
    "nearest_rounding": (
        ROUNDING, "    m_out.copy_(round_stochastic(m, h >> 16))\n    v_out.copy_(round_stochastic(v, h & LOW16))\n",
        "    m_out.copy_(m)\n    v_out.copy_(v)\n", "torch ops: round-to-nearest instead of stochastic rounding"),
    "kernel_truncates_m": (
        KERNEL, "m_bits = (m.to(tl.uint32, bitcast=True) + (h >> 16)) & 0xFFFF0000",
        "m_bits = (m.to(tl.uint32, bitcast=True) + 0) & 0xFFFF0000", "kernel: m truncated toward zero (biased)"),
    "kernel_same_noise": (
        KERNEL, "v_bits = (v.to(tl.uint32, bitcast=True) + (h & 0xFFFF)) & 0xFFFF0000",
        "v_bits = (v.to(tl.uint32, bitcast=True) + (h >> 16)) & 0xFFFF0000", "kernel: m and v rounded with the same noise"),
    "kernel_moment_row_stride": (
        KERNEL, "moments[:, width:], moments.stride(0), slots", "moments[:, width:], weight.stride(0), slots",
        "kernel: the moment rows' stride of the fp32 rows: a slot writes its moments into another slot's row"),
    "kernel_v_over_m": (
        KERNEL, "_launch(weight, grad, moments[:, :width], moments[:, width:],", "_launch(weight, grad, moments[:, :width], moments[:, :width],",
        "kernel: v read and written where m is"),
    "group_factors_from_first_rows": (
        OPS, "groups.append((dtype, [ids[i] for i in rows], self.select(rows)))",
        "groups.append((dtype, [ids[i] for i in rows], self.select(list(range(len(rows))))))",
        "mixed dtypes: each group steps with the factors of the step's first slots"),
    "key_by_slot": (
        STEPS, "stores.append((h.state_dtype, noise_key(st.seed, st.step)))", "stores.append((h.state_dtype, noise_key(slot, st.step)))",
        "the loop's step: rounding noise keyed by the slot index, not the tenant's seed"),
    "tinker_key_step_zero": (
        STEPS, "noise_keys=(noise_key(state.seed, state.step),)", "noise_keys=(noise_key(state.seed, 0),)",
        "the Tinker step: the same rounding noise at every update"),
    "views_v_over_m": (
        BUFFERS, "first = half * total + start", "first = start",
        "buffers: the bf16 exp_avg_sq views are the exp_avg ones (a checkpoint saves m twice)"),
    "swap_kinds_wrong_row": (
        BUFFERS, 'else ("weight", "grad", "exp_avg")', 'else ("weight", "grad", "exp_avg_sq")',
        "swap: a bf16 slot's snapshot copies the unused exp_avg_sq row instead of its moments"),
    "checkpoint_reads_fp32_views": (
        CHECKPOINT, "trainer.slots.read_full(slot, state_kind(kind, state.hyper.state_dtype), state.rank, layers)",
        "trainer.slots.read_full(slot, kind, state.rank, layers)",
        "checkpoint: a bf16 slot's moments read through the fp32 views (their bytes misread)"),
}

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], MUTATIONS, TESTS))
