"""Plant issue 43 item 6's off-by-one bugs one at a time; a fast unit test must fail for each (the
runner of tests/unit/expert_kernel_mutations.py: each file is restored after its run).

    python -m tests.unit.off_by_one_mutations                        # every mutation (a few minutes)
    python -m tests.unit.off_by_one_mutations client_logprob_shift   # one

Three groups, each run against its own tests:
* the AdamW update number: the trainer's plants of tests/reference/plant_mutation.py (its module doc
  says which), against test_adamw_update_numbers.py;
* the sampler's log-probabilities and their tokens: the rows (plant_mutation.py) and the rollout side
  below, from the client's reading of SGLang's answer to the loop's train samples, against
  test_rollout_logprob_alignment.py (of test_rollout_trajectories, test_rollout_groups,
  test_trainer_batch and test_losses, only the first sees any: flat_logprob_shift and
  train_sample_prompt_pad);
* the unembedding's rows and their slot or adapter: the trainer's (plant_mutation.py) against
  test_unembed_routing.py, SGLang's CPU fix (rollout/engines/sglang_lm_head_rows.py, below) against
  test_sglang_lm_head_rows.py.
"""

from __future__ import annotations

import sys

from tests.reference.plant_mutation import MUTATIONS as TRAINER
from tests.unit.expert_kernel_mutations import main

LM_HEAD = "rollout/engines/sglang_lm_head_rows.py"
PASSES = "    passes = backend._get_lm_head_pass_segments(weight_indices, pruned)\n"


def _trainer(why: dict[str, str]) -> dict[str, tuple[str, str, str, str]]:
    return {name: (*TRAINER[name], text) for name, text in why.items()}


UPDATE_NUMBER = _trainer({
    "adamw_row_step_plus_one": "the loop's per-slot rows carry the update number one too high",
    "adamw_row_step_minus_one": "the loop's per-slot rows carry the previous update number",
    "tinker_step_plus_one": "the Tinker step's factors for the update number one too high",
    "tinker_step_minus_one": "the Tinker step's factors for the previous update number",
    "bias2_next_update": "the second moment's bias correction of the next update",
    "bias1_previous_update": "the first moment's bias correction of the previous update",
    "bias1_next_update": "the first moment's bias correction of the next update",
    "schedule_next_update": "the warm-up's learning rate of the next update",
})
ALIGNMENT = _trainer({
    "rollout_q_of_input_token": "row position t holds the log-prob of token t, not of the token it predicts",
    "loss_mask_of_input_token": "row position t holds token t's loss mask, not the predicted token's",
    "labels_not_shifted": "row position t's label is token t itself",
}) | {  # name: (file, exact text, replacement, what the bug is)
    "client_logprob_shift": ("rollout/engines/client.py", "logprobs = [float(e[0]) for e in raw_lp]",
                             "logprobs = [0.0] + [float(e[0]) for e in raw_lp][:-1]",
                             "the client reads each generated token's log-prob at the next token"),
    "client_prompt_logprob_shift": (
        "rollout/engines/client.py",
        "prompt_logprobs=None if raw_in is None else [None if e[0] is None else float(e[0]) for e in raw_in],",
        "prompt_logprobs=None if raw_in is None else [None] + [None if e[0] is None else float(e[0]) for e in raw_in][:-1],",
        "the client reads the prompt's log-probs one token late"),
    "context_logprob_shift": ("rollout/context.py", "tuple(r.logprobs)", "tuple(r.logprobs[1:]) + (0.0,)",
                              "a generation keeps the log-prob of the token after each of its tokens"),
    "flat_logprob_shift": ("rollout/trajectory.py", "lps.extend(s.logprobs if learned else [0.0] * len(s.token_ids))",
                           "lps.extend(s.logprobs[1:] + (0.0,) if learned else [0.0] * len(s.token_ids))",
                           "a flattened trajectory's model segments shifted by one token"),
    "group_logprob_shift": ("rollout/groups.py", "logprobs=flat.logprobs,", "logprobs=[0.0] + flat.logprobs[:-1],",
                            "a group's sample holds its log-probs one token late"),
    "train_sample_prompt_pad": ("service/tenants/batches.py", "rollout_logprobs=[0.0] * n_prompt + list(s.logprobs)",
                                "rollout_logprobs=[0.0] * (n_prompt - 1) + list(s.logprobs) + [0.0]",
                                "the train sample pads the prompt one entry short: every log-prob one token early"),
}
ROUTING = _trainer({
    "unembed_segments_skip_gap": "a slot without the unembedding shifts the next slots' segments",
    "unembed_segments_first_group": "segments chosen by the attention scales, not the unembedding's",
    "unembed_z_first_group_scale": "z scaled by the slot's attention scale",
    "unembed_every_slot": "each segment's delta added to every token of the chunk",
    "unembed_scale": "z without the slot's scale",
    "unembed_chunk_off_by_one": "a chunk's last row never gets the delta",
}) | {
    "lm_head_whole_lengths": (LM_HEAD, "pruned = get_lm_head_pruned_lens(forward_batch)\n",
                              "pruned = get_lm_head_pruned_lens(forward_batch) and list(forward_batch.extend_seq_lens_cpu)\n",
                              "the tables count the whole sequences' rows, not the pruned ones (SGLang 0.5.23's bug)"),
    "lm_head_pass_sequence_adapters": (LM_HEAD, "[table(w, lens) for w, lens in passes]",
                                       "[table(weight_indices[: len(lens)], lens) for w, lens in passes]",
                                       "each pass's segments labelled with the batch's sequence adapters"),
    "lm_head_no_pass_tables": (LM_HEAD, "None if passes is None else [table(w, lens) for w, lens in passes]", "None",
                               "no per-pass tables: every pass routed by the whole batch's"),
    "lm_head_pass_one_row_late": (
        LM_HEAD, PASSES,
        PASSES + "    if passes is not None:\n        from sglang.srt.environ import envs\n"
                 "        from sglang.srt.lora.utils import build_lm_head_pass_segments\n\n"
                 "        passes = build_lm_head_pass_segments(weight_indices, pruned, envs.SGLANG_LOGPROB_CHUNK_SIZE.get() + 1)\n",
        "the passes' tables cut one row later than the log-prob processor cuts the rows"),
    "lm_head_expected_rows_plus_one": (LM_HEAD, "expected_tokens=rows,", "expected_tokens=rows + 1,",
                                       "a table expects one row more than it routes"),
    "lm_head_b_whole_table": (LM_HEAD, "        with _routed_by(self, pruned_batch_info):\n            return run_b(",
                              "        with _routed_by(self, None):\n            return run_b(",
                              "lora_B's GEMM ignores the pruned table (routes by the whole sequences)"),
    "lm_head_unpatched": (LM_HEAD, "    TorchNativeLoRABackend.prepare_lora_batch = prepare_lora_batch\n", "",
                          "no pruned tables built at all (SGLang 0.5.23 as it is)"),
}
GROUPS = [
    (UPDATE_NUMBER, ["tests/unit/test_adamw_update_numbers.py"]),
    (ALIGNMENT, ["tests/unit/test_rollout_logprob_alignment.py"]),
    (ROUTING, ["tests/unit/test_unembed_routing.py", "tests/unit/test_sglang_lm_head_rows.py"]),
]


def run(argv: list[str]) -> int:
    known = {name for mutations, _ in GROUPS for name in mutations}
    unknown = [n for n in argv if n not in known]
    if unknown:
        raise SystemExit(f"unknown mutations {unknown}: choose from {', '.join(sorted(known))}")
    status = 0
    for mutations, tests in GROUPS:
        names = [n for n in mutations if not argv or n in argv]
        if names:
            status |= main(names, mutations, tests)
    return status


if __name__ == "__main__":
    raise SystemExit(run(sys.argv[1:]))
