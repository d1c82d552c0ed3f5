"""Plant bugs in the step overlap's plan and its AdamW block kernel one at a time; a test must fail
for each (the runner of tests/unit/expert_kernel_mutations.py; Triton's interpreter on the CPU).

    python -m tests.unit.step_overlap_mutations            # every mutation (about a minute)

The stream path's order (what each layer waits for, where each event is recorded, the step stream
waiting for the main one) is checked on the CPU with stand-in streams and events
(test_step_overlap.py::test_each_layer_waits_for_the_event_after_its_own_rows): its plants are
the last four below. That the waits really hold a forward back needs CUDA streams: a planted bug
of its own, tests/gpu/test_step_overlap_gpu.py (the waits switched off)."""

from __future__ import annotations

import sys

from tests.unit.expert_kernel_mutations import main

KERNEL = "trainer/kernels/triton_adamw.py"
PLAN = "trainer/optim/step_overlap.py"
TESTS = ["tests/unit/test_step_overlap.py", "tests/unit/test_triton_adamw.py"]

MUTATIONS = {  # name: (file, exact text, replacement, what the bug is)
    "block_mask_one_past": (KERNEL, "mask = lanes < tl.load(widths_ptr + blk)", "mask = lanes <= tl.load(widths_ptr + blk)",
                            "a block updates one column past its range"),
    "block_width_full": (KERNEL, "widths.append(min(BLOCK, hi - c))", "widths.append(BLOCK)",
                         "a range's last block runs on into the next range"),
    "block_row_from_program": (KERNEL, "row = tl.load(slots_ptr + d).to(tl.int64)", "row = d.to(tl.int64)",
                               "the d-th stepping slot's factors applied to row d, not to its slot"),
    "merge_across_gaps": (PLAN, "if out and lo <= out[-1][1]:", "if out and lo <= out[-1][1] + 2:",
                          "ranges two columns apart merged: the gap's columns stepped twice"),
    "one_chunk_for_all": (PLAN, 'return int(found.group(1)) if found else float("inf")', 'return float("inf")',
                          "every layer in one chunk: layer 0's forward waits for the whole step"),
    "chunks_not_in_forward_order": (PLAN, "keys = sorted({decoder_index(n) for n in names})",
                                    "keys = sorted({decoder_index(n) for n in names}, reverse=True)",
                                    "the last layer's rows updated first"),
    "threshold_inclusive": (PLAN, "len(slots) * buf.weight.shape[1] < self.min_params", "len(slots) * buf.weight.shape[1] <= self.min_params",
                            "a step of exactly min_params parameters runs in order"),
    "wait_previous_group": (PLAN, "event = self._events[self._chunk_of[id(layer)]]",
                            "event = self._events[self._chunk_of[id(layer)] - 1]",
                            "a layer waits for the previous layer group's event (its rows not yet written)"),
    "event_before_launch": (PLAN, "                for launch in launches:\n                    launch(blocks)\n"
                                  "                event = torch.cuda.Event()\n                event.record(self.stream)\n",
                            "                event = torch.cuda.Event()\n                event.record(self.stream)\n"
                            "                for launch in launches:\n                    launch(blocks)\n",
                            "each layer group's event recorded before its launches"),
    "step_stream_no_wait": (PLAN, "        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the gradients, the norms\n",
                            "", "the step stream starts without waiting for the gradients and norms"),
    "one_launch_per_group": (PLAN, "for launch in launches:\n                    launch(blocks)",
                             "for launch in launches[:1]:\n                    launch(blocks)",
                             "a step of float32 and bfloat16 slots launches only the float32 rows"),
}

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:], MUTATIONS, TESTS))
