"""The publish export's row snapshot against the per-layer gather, under any TP layout.

`SlotExporter.snapshot_peft` (trainer/export/slot_export.py) exports a slot from its one buffer row (one cast, one TP
all-gather of the split columns, one host copy), and the writer takes the row apart on the host
(`peft_from_snapshot`). The checkpoint path gathers layer by layer instead (`slot_state_tensors`:
`full_a`/`full_b`, an all-gather per split tensor). Both must give the same PEFT tensors bit for
bit; `slot_state_tensors` at TP=2 equals TP=1 (the equivalence tests), and the TP=1 export
equals HF + PEFT (the parity tests), so this closes the chain for TP=2 exports."""

from __future__ import annotations

import torch

from tests.trainer_probes import slot_status


def export_matches_full_tensors(trainer, hypers, batch, folder) -> dict:  # noqa: ANN001
    """Collective (every rank calls it). Fresh slots from ``hypers``, one train call on ``batch``,
    then per slot: the row-snapshot export (fp32) against slot_to_hf of the per-layer gather, and a
    background bf16 export of slot 0 written to ``folder`` against the same rounded. Rank 0
    returns {"names": tensors compared, "mismatches": [...]}; other ranks return {}."""
    from trainer.swap.slot_checkpoint import slot_state_tensors

    from safetensors.torch import load_file

    from trainer.export.moe_peft import expert_peft_tensors
    from trainer.export.peft_io import slot_to_hf

    for slot, h in enumerate(hypers):
        if slot_status(trainer, slot)["active"]:
            trainer.clear_slot(slot)
        trainer.init_slot(slot, h, seed=200 + slot)
    trainer.train(batch)
    mismatches, names = [], 0
    refs = {}
    for slot, h in enumerate(hypers):
        _, got = trainer.export.peft_tensors(slot)
        a_full, b_full = slot_state_tensors(trainer, slot)["weight"]  # the layers the slot trains
        trained = trainer.slots.trained_layers(h)
        dense = [layer for layer in trained if layer in trainer.dense_layers]
        experts = [layer for layer in trained if layer in trainer.expert_layers]
        ref = slot_to_hf(trainer.base, dense, a_full, b_full) | expert_peft_tensors(trainer.base, experts, a_full, b_full)
        refs[slot] = ref
        if sorted(got) != sorted(ref):
            mismatches.append((slot, "names", sorted(set(got) ^ set(ref))[:4]))
            continue
        names += len(ref)
        mismatches += [(slot, k) for k in ref if not torch.equal(got[k], ref[k])]
    trainer.export.export_peft_in_background(0, folder, dtype="bfloat16")
    trainer.export.wait_export(folder)
    if trainer.layout.rank != 0:
        return {}
    written = load_file(f"{folder}/adapter_model.safetensors")
    if sorted(written) != sorted(refs[0]):
        mismatches.append((0, "bf16 names"))
    else:
        mismatches += [(0, "bf16", k) for k in written if not torch.equal(written[k], refs[0][k].to(torch.bfloat16))]
    return {"names": names, "mismatches": mismatches}
