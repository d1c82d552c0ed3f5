"""Plant one of issue 13's four trainer bugs, one of issue 25's loss bugs, or one of the unembedding
LoRA's four, in the working tree, to watch the tests catch it.

    python -m tests.reference.plant_mutation betas_swapped      # or kl_sign, first_betas_eps, first_weight_decay
    python -m pytest tests/reference tests/unit/test_losses.py -q  # must fail
    git checkout trainer/optim/slot_steps.py trainer/losses/table.py trainer/losses/rows.py                  # undo

The loss bugs (MUTATIONS' last eleven), each caught (measured) by tests/unit/test_tinker_losses.py
(T), tests/unit/test_losses.py (L), tests/unit/test_tinker_wire.py (W), tests/reference (R) or
tests/integration/test_tinker_ops.py (O):
* ce_sign, is_no_advantage: T (values and gradients of that loss);
* ppo_offset_bound (the lower bound taken as an offset), cispo_no_stopgrad, dro_no_half: T, 3-5 cases each;
* gspo_mean_all (the sequence ratio over every position, not the marked ones): T 4 cases, O (loss:sum
  -0.864 vs HF -2.018); gspo_ratio_grad (gradient through s): T 6 cases;
* clip_min (the shared clip's max turned min): T 12 cases, L 3 (the REST PPO cases);
* default_high (1.28 for Tinker's 1.2): T 10 cases, W; rest_bound (clip_high's offset read from
  clip_low): T (the one-clip test), R (REST slots against the HF reference);
* loss_sum_last (``loss_sum[c] =`` for ``+=``): O (loss:sum 115.3 vs HF 259.2).

The unembedding's (issue 25): unembed_every_slot (each segment's delta added to every token of the
chunk), unembed_scale (z without the slot's alpha / r), unembed_b_unsplit (B's columns counted as
replicated over TP, not split over the vocabulary), unembed_chunk_off_by_one (a chunk's last row
never gets the delta); undo with ``git checkout trainer/kernels/chunked_logprobs.py trainer/lora/unembed_lora.py``.
Measured (which test files fail):
* unembed_every_slot: tests/unit/test_chunked_logprobs.py (19 tests), this reference test, test_unembed_lora.py
  (2), test_trainer_equivalence.py's TP=2 test;
* unembed_scale: this reference test, test_unembed_lora.py (2: HF+PEFT parity, full-logits path vs chunked);
* unembed_b_unsplit: test_trainer_equivalence.py's TP=2 test (TP=2 vs TP=1: 6.1e-4, tolerance 3e-5);
* unembed_chunk_off_by_one: tests/unit/test_chunked_logprobs.py (13 tests), test_unembed_lora.py (the packed
  pass's log-probs vs HF+PEFT: 3.9e-3). This reference test does not see it: a packed stream's last
  token has no target, and its chunks (2048 tokens) end there.

Issue 13's trainer bugs, measured by this reference test (max relative error vs the reference per
slot, REL_TOL 5e-5; clean run <= 1.2e-5):
* betas_swapped (Adam beta1/beta2 exchanged): losses up to 4.5e-2, weights up to 8.6e-1;
* kl_sign (the k3 KL term subtracted): slots with kl_coef > 0: losses 2.2e-3 / 4.8e-2, B weights 7.6e-2 / 8.9e-1;
  also tests/unit/test_losses.py::test_k3_kl_value_and_sign;
* first_betas_eps (every slot steps with the first stepping slot's betas and eps): slots 1-3,
  losses >= 5.6e-3, B weights >= 4.0e-1; also test_trainer_equivalence's first-step test;
* first_weight_decay (every slot steps with the first stepping slot's weight decay): slots 1-3,
  grad norms >= 4.2e-4, A weights >= 6.6e-4, B weights >= 2.3e-4.

Issue 43 item 6's off-by-one bugs (MUTATIONS' last fourteen), each caught (measured) by a unit test
of seconds; python -m tests.unit.off_by_one_mutations replays them with the rollout side's and
SGLang's (it restores every file itself):
* the AdamW update number (tests/unit/test_adamw_update_numbers.py, torch ops and Triton kernel):
  adamw_row_step_plus_one / _minus_one (the loop's per-slot rows), tinker_step_plus_one / _minus_one
  (adam_step), bias2_next_update, bias1_previous_update, bias1_next_update (the factors' formula),
  schedule_next_update (the warm-up's update number). test_compact_adamw.py's step-function test
  sees all but the last too, by a thinner margin (tinker_step_minus_one: 2.1e-5 against its 2e-6);
* the rows' alignment (tests/unit/test_rollout_logprob_alignment.py): rollout_q_of_input_token,
  loss_mask_of_input_token, labels_not_shifted (test_trainer_batch, test_losses, test_rollout_groups
  and test_rollout_trajectories see none of them);
* the unembedding's routing (tests/unit/test_unembed_routing.py): unembed_segments_skip_gap (a slot
  that does not train the unembedding shifts the next slots' segments), unembed_segments_first_group
  (segments chosen by the attention scales), unembed_z_first_group_scale (z scaled by them), none
  seen by test_chunked_logprobs.py or test_trainer_multi_lora.py; it also catches unembed_every_slot,
  unembed_scale (before it: only the reference and integration tests) and unembed_chunk_off_by_one.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.paths import REPO

ADAM_ROW = "hyper_rows.append((lr, h.weight_decay, h.betas[0], h.betas[1], h.eps, st.step))"
FIRST = "h0 = states[due.index(stepping[0])].hyper; "
TINKER_STEP = "step=f64(state.step),"
BIAS1 = "-lr / (1 - beta1**step)"
SEGMENT_END = "                out.append((slot, start, start + n))\n            start += n\n"
IN_CHUNK = "return [(k, max(s, start) - start, min(e, end) - start) for k, s, e in self.segments if s < end and e > start]"
MUTATIONS = {
    "unembed_every_slot": ("trainer/kernels/chunked_logprobs.py", IN_CHUNK, "return [(k, 0, end - start) for k, s, e in self.segments]"),
    "unembed_scale": ("trainer/lora/unembed_lora.py", "LogitLora(z=z * r.scale_column(z.dtype, UNEMBED),", "LogitLora(z=z,"),
    "unembed_b_unsplit": ("trainer/lora/unembed_lora.py", "        self._output_weight = output_weight\n",
                          "        self._output_weight = output_weight\n        self.b_is_tp_split = False\n"),
    "unembed_chunk_off_by_one": ("trainer/kernels/chunked_logprobs.py", IN_CHUNK, IN_CHUNK.replace("min(e, end)", "min(e, end - 1)")),
    "betas_swapped": ("trainer/optim/slot_steps.py", ADAM_ROW, ADAM_ROW.replace("h.betas[0], h.betas[1]", "h.betas[1], h.betas[0]")),
    "kl_sign": ("trainer/losses/rows.py", "loss = loss + inp.kl_coef.unsqueeze(1) * kl", "loss = loss - inp.kl_coef.unsqueeze(1) * kl"),
    "first_betas_eps": ("trainer/optim/slot_steps.py", ADAM_ROW,
                        FIRST + ADAM_ROW.replace("h.betas[0], h.betas[1], h.eps", "h0.betas[0], h0.betas[1], h0.eps")),
    "first_weight_decay": ("trainer/optim/slot_steps.py", ADAM_ROW, FIRST + ADAM_ROW.replace("h.weight_decay", "h0.weight_decay")),
    # the losses (issue 25): one per loss, the shared clip, its REST edge, a default, loss:sum
    "ce_sign": ("trainer/losses/table.py", 'return TokenLoss(-lp * inp["weights"])', 'return TokenLoss(lp * inp["weights"])'),
    "is_no_advantage": ("trainer/losses/table.py", 'return TokenLoss(-_ratio(lp, inp) * inp["advantages"])', "return TokenLoss(-_ratio(lp, inp))"),
    "ppo_offset_bound": ("trainer/losses/table.py", 'clipped_surrogate(_ratio(lp, inp), inp["advantages"], cfg["clip_low_threshold"]',
                         'clipped_surrogate(_ratio(lp, inp), inp["advantages"], 1 - cfg["clip_low_threshold"]'),
    "cispo_no_stopgrad": ("trainer/losses/table.py", "ratio = _ratio(lp, inp).detach()", "ratio = _ratio(lp, inp)"),
    "dro_no_half": ("trainer/losses/table.py", '0.5 * cfg["beta"] * (lp - inp["logprobs"]) ** 2', 'cfg["beta"] * (lp - inp["logprobs"]) ** 2'),
    "gspo_mean_all": ("trainer/losses/table.py", 'marked = (inp["sequence_ratio_mask"] != 0).to(lp.dtype)',
                      'marked = torch.ones_like(lp)'),
    "gspo_ratio_grad": ("trainer/losses/table.py", 'torch.where(marked > 0, lp.detach() - inp["logprobs"]', 'torch.where(marked > 0, lp - inp["logprobs"]'),
    "clip_min": ("trainer/losses/table.py", "return torch.maximum(unclipped, clipped), (clipped > unclipped).detach()",
                 "return torch.minimum(unclipped, clipped), (clipped > unclipped).detach()"),
    "default_high": ("trainer/losses/table.py", '_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}',
                     '_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}'),
    "rest_bound": ("trainer/config.py", "return 1.0 - self.clip_low, 1.0 + self.clip_high",
                   "return 1.0 - self.clip_low, 1.0 + self.clip_low"),
    "loss_sum_last": ("trainer/step/round_runner.py", "loss_sum[c] += ", "loss_sum[c] = "),
    # issue 43 item 6: off-by-one bugs with fast unit tests of their own (see the module doc)
    "adamw_row_step_plus_one": ("trainer/optim/slot_steps.py", ADAM_ROW, ADAM_ROW.replace("st.step))", "st.step + 1))")),
    "adamw_row_step_minus_one": ("trainer/optim/slot_steps.py", ADAM_ROW, ADAM_ROW.replace("st.step))", "st.step - 1))")),
    "tinker_step_plus_one": ("trainer/optim/slot_steps.py", TINKER_STEP, "step=f64(state.step + 1),"),
    "tinker_step_minus_one": ("trainer/optim/slot_steps.py", TINKER_STEP, "step=f64(state.step - 1),"),
    "bias2_next_update": ("trainer/optim/per_slot_optim.py", "(1 - beta2**step).sqrt()", "(1 - beta2**(step + 1)).sqrt()"),
    "bias1_previous_update": ("trainer/optim/per_slot_optim.py", BIAS1, "-lr / (1 - beta1**(step - 1))"),
    "bias1_next_update": ("trainer/optim/per_slot_optim.py", BIAS1, "-lr / (1 - beta1**(step + 1))"),
    "schedule_next_update": ("trainer/optim/slot_steps.py", "lr = lr_at(st.hyper, st.step + 1)", "lr = lr_at(st.hyper, st.step + 2)"),
    "rollout_q_of_input_token": ("trainer/step/micro_batch.py", "rollout[j, : n - 1] = torch.tensor(x.rollout_logprobs[1:]",
                                 "rollout[j, : n - 1] = torch.tensor(x.rollout_logprobs[:-1]"),
    "loss_mask_of_input_token": ("trainer/step/micro_batch.py", "mask[j, : n - 1] = torch.tensor(x.loss_mask[1:]",
                                 "mask[j, : n - 1] = torch.tensor(x.loss_mask[:-1]"),
    "labels_not_shifted": ("trainer/step/micro_batch.py", "labels[j, : n - 1] = ids[j, 1:n]", "labels[j, : n - 1] = ids[j, : n - 1]"),
    "unembed_segments_skip_gap": ("trainer/lora/multi_lora.py", SEGMENT_END, SEGMENT_END.replace("            start += n", "                start += n")),
    "unembed_segments_first_group": ("trainer/lora/multi_lora.py", "if n and self.scales.host[group][slot] != 0.0:",
                                     "if n and self.scales.host[0][slot] != 0.0:"),
    "unembed_z_first_group_scale": ("trainer/lora/unembed_lora.py", "LogitLora(z=z * r.scale_column(z.dtype, UNEMBED),",
                                    "LogitLora(z=z * r.scale_column(z.dtype, 0),"),
}


def plant(name: str, root: Path = REPO) -> None:
    if name not in MUTATIONS:
        raise SystemExit(f"unknown mutation {name!r}: choose one of {', '.join(MUTATIONS)}")
    rel, old, new = MUTATIONS[name]
    path = root / rel
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{rel}: the line to mutate is not there exactly once (already planted, or the code moved)")
    path.write_text(text.replace(old, new))
    print(f"planted {name} in {rel}; undo with: git checkout {rel}")


if __name__ == "__main__":
    plant(sys.argv[1] if len(sys.argv) > 1 else "")
