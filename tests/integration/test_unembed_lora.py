"""LoRA on the unembedding (lm_head) on the real tiny Megatron model (fp32, CPU; tied embeddings).

* Export parity: slots with different target sets (all three, the unembedding alone, MLP + the
  unembedding, attention + MLP), trained together, exported as PEFT folders (``lm_head`` among
  target_modules, lora_A/lora_B in HF names); HF + peft loads each folder as it is and gives the
  trainer's logits (full-logits path) and its per-token log-probs (the chunked path the trainer
  trains with, through the packed LoRA pass).
* The same steps through the full-logits path (chunked_logprobs off) and the padded path (packed
  off) train the same weights as the default packed chunked path.
* Imports: our export loads back bit-exactly; a peft-made folder with lm_head (peft also saves the
  tied base weight as lm_head.base_layer.weight) loads and gives peft's logits; a changed base
  copy, lm_head LoRA into a slot that does not train the unembedding, and the unembedding on a
  trainer without output_layer LoRA are refused with messages that name the problem.
* Checkpoints and swaps carry the unembedding LoRA exactly (weights, moments, gradient).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.test_trainer_slots import batch  # random samples of the given slots, seeded
from tests.trainer_probes import slot_status

pytestmark = pytest.mark.integration

TARGETS = [("attention", "mlp", "unembed"), ("unembed",), ("mlp", "unembed"), ("attention", "mlp")]
RANKS = [4, 8, 2, 4]
TOL = 1e-5  # fp32, Megatron vs HF kernels (FINDINGS: logits within 3e-7 without LoRA)


def make_trainer(tiny_world, **kw):
    from trainer.config import TrainerConfig
    from trainer.core import MultiLoraTrainer

    return MultiLoraTrainer(TrainerConfig(base_model_path=str(tiny_world / "model"), num_slots=4, max_rank=8,
                                          micro_batch_tokens=48, **kw))


@pytest.fixture(scope="module")
def trainer(tiny_world):
    return make_trainer(tiny_world)


def hyper(slot, **kw):
    from trainer.config import SlotHyperParams

    base = dict(rank=RANKS[slot], alpha=2.0 * RANKS[slot], lr=3e-2, samples_per_step=2, eps=1e-2,
                objective="sft" if slot % 2 else "rl", targets=TARGETS[slot])
    return SlotHyperParams(**(base | kw))


def train_scenario(trainer):
    for slot in range(4):
        if slot_status(trainer, slot)["active"]:
            trainer.clear_slot(slot)
        trainer.init_slot(slot, hyper(slot), seed=30 + slot)
    for seed in range(3):
        trainer.train(batch([0, 0, 1, 1, 2, 2, 3, 3], seed=seed))


def weights(trainer, slot):
    from trainer.swap.slot_checkpoint import slot_state_tensors

    return slot_state_tensors(trainer, slot)


def hf_peft(hf_model, folder):
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model, str(folder)).eval()


@pytest.fixture(scope="module")
def trained(trainer):
    train_scenario(trainer)
    return {slot: weights(trainer, slot) for slot in range(4)}


def test_exports_equal_hf_peft_logits_and_logprobs(trainer, trained, hf_model, tmp_path):
    from tests.trainer_probes import forward_logits

    ids = torch.randint(0, 400, (2, 15), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        base_logits = hf_model(ids).logits
    for slot in range(4):
        folder = trainer.export.export_peft(slot, tmp_path / f"slot{slot}")
        cfg = json.loads((tmp_path / f"slot{slot}" / "adapter_config.json").read_text())
        assert ("lm_head" in cfg["target_modules"]) == ("unembed" in TARGETS[slot]), cfg["target_modules"]
        assert ("q_proj" in cfg["target_modules"]) == ("attention" in TARGETS[slot])
        assert ("down_proj" in cfg["target_modules"]) == ("mlp" in TARGETS[slot])
        model = hf_peft(hf_model, folder)
        try:
            with torch.no_grad():
                ref = model(ids).logits
        finally:
            model.unload()
        ours = forward_logits(trainer, ids, slot)  # the full-logits path (UnembedLora.forward)
        assert (ours - ref).abs().max().item() <= TOL, slot
        # the chunked path the trainer trains with: the packed LoRA pass's per-token log-probs
        seqs = ids.tolist()
        targets = [s[1:] + [s[0]] for s in seqs]  # any target per position
        lp = trainer.packed_lora_pass(seqs, [slot, slot], targets)
        ref_lp = torch.log_softmax(ref.float(), -1).gather(-1, torch.tensor(targets).unsqueeze(-1)).reshape(-1)
        assert (lp - ref_lp).abs().max().item() <= TOL, slot
        assert (ref - base_logits).abs().max().item() > 1e-2  # the adapter changes the output
    # the unembedding-only slot changes the logits and nothing upstream of them
    _, tensors = trainer.export.peft_tensors(1)
    assert sorted(tensors) == ["base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"]
    assert tensors["base_model.model.lm_head.lora_B.weight"].shape == (400, RANKS[1])
    assert tensors["base_model.model.lm_head.lora_B.weight"].abs().max() > 0


def test_full_logits_and_padded_paths_train_like_the_chunked_path(tiny_world, trained):
    """The unembedding's LoRA in the full-logits path (Megatron calls the output layer) and in the
    padded micro-batch path trains the same weights as the default packed chunked path."""
    for kw in (dict(chunked_logprobs=False), dict(packed=False)):
        other = make_trainer(tiny_world, **kw)
        train_scenario(other)
        for slot in range(4):
            got = weights(other, slot)
            for kind in ("weight", "exp_avg", "exp_avg_sq"):
                for side in (0, 1):
                    for name, t in trained[slot][kind][side].items():
                        err = (got[kind][side][name] - t).abs().max().item() / max(t.abs().max().item(), 1e-30)
                        assert err <= 1e-5, (kw, slot, kind, name, err)
        del other


def test_own_export_and_peft_made_folders_import(trainer, trained, hf_model, tmp_path):
    from peft import LoraConfig, get_peft_model

    from tests.trainer_probes import forward_logits

    trainer.export.export_peft(0, tmp_path / "ours")
    trainer.clear_slot(3)
    trainer.init_slot(3, hyper(0), seed=1, init_from=tmp_path / "ours")
    a, b = weights(trainer, 0)["weight"], weights(trainer, 3)["weight"]
    assert "output_layer" in a[0] and all(torch.equal(a[i][k], b[i][k]) for i in (0, 1) for k in a[i])

    torch.manual_seed(0)
    peft_model = get_peft_model(hf_model, LoraConfig(r=2, lora_alpha=4, target_modules=["lm_head", "q_proj"],
                                                     init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "hf_made")
    peft_model.unload()
    from safetensors.torch import load_file, save_file

    raw = load_file(str(tmp_path / "hf_made" / "adapter_model.safetensors"))
    assert "base_model.model.lm_head.base_layer.weight" in raw  # peft saves the tied base weight too
    ids = torch.randint(0, 400, (2, 11), generator=torch.Generator().manual_seed(7))
    model = hf_peft(hf_model, tmp_path / "hf_made")
    try:
        with torch.no_grad():
            ref = model(ids).logits
    finally:
        model.unload()
    trainer.clear_slot(3)
    trainer.init_slot(3, hyper(0, rank=2, alpha=4.0, targets=("attention", "unembed")), seed=1,
                      init_from=tmp_path / "hf_made")
    assert (forward_logits(trainer, ids, 3) - ref).abs().max().item() <= TOL

    # refusals: nothing changes (the slot stays free)
    trainer.clear_slot(3)
    (tmp_path / "tampered").mkdir()
    (tmp_path / "tampered" / "adapter_config.json").write_text((tmp_path / "hf_made" / "adapter_config.json").read_text())
    raw["base_model.model.lm_head.base_layer.weight"] = raw["base_model.model.lm_head.base_layer.weight"] * 1.01
    save_file(raw, str(tmp_path / "tampered" / "adapter_model.safetensors"))
    cases = [
        (hyper(0, rank=2, alpha=4.0, targets=("attention", "unembed")), tmp_path / "tampered",
         "lm_head.base_layer.weight differs from this base model's output weight"),
        (hyper(0, rank=2, alpha=4.0, targets=("attention",)), tmp_path / "hf_made",
         r"adapter has LoRA on \['lm_head'\], which the slot does not train \(target groups off: \['unembed'\]\)"),
        (hyper(0, targets=("mlp",)), tmp_path / "ours", r"which the slot does not train .*'attention'.*'unembed'"),
    ]
    for hp, folder, message in cases:
        with pytest.raises(ValueError, match=message):
            trainer.init_slot(3, hp, seed=1, init_from=folder)
        assert slot_status(trainer, 3) == {"slot": 3, "active": False}


def test_unembedding_needs_output_layer_lora_in_the_trainer(tiny_world, trainer, tmp_path):
    from trainer.swap.slot_checkpoint import load_slot_state, save_slot_state

    train_scenario(trainer)
    save_slot_state(trainer, 1, tmp_path / "unembed_state")  # trains the unembedding only
    save_slot_state(trainer, 3, tmp_path / "plain_state")  # attention + MLP
    narrow = make_trainer(tiny_world, target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
    with pytest.raises(ValueError, match=r"targets \['unembed'\] have no LoRA layers in this trainer .* allowed targets "
                                         r"here: \['attention', 'mlp'\]"):
        narrow.init_slot(0, hyper(1), seed=1)
    with pytest.raises(ValueError, match=r"the state has LoRA on \['output_layer'\], which this trainer has none of"):
        load_slot_state(narrow, 0, tmp_path / "unembed_state")
    assert slot_status(narrow, 0) == {"slot": 0, "active": False}
    load_slot_state(narrow, 0, tmp_path / "plain_state")  # a state without the unembedding loads there
    a, b = weights(trainer, 3)["weight"], weights(narrow, 0)["weight"]
    assert all(torch.equal(a[i][k], b[i][k]) for i in (0, 1) for k in a[i])


def test_checkpoint_and_swap_carry_the_unembedding_exactly(trainer, tmp_path):
    from trainer.swap.slot_checkpoint import load_slot_state, save_slot_state

    train_scenario(trainer)
    trainer.train(batch([2], seed=9))  # a pending gradient too (samples_per_step 2)
    before = weights(trainer, 2)
    assert before["grad"][1]["output_layer"].abs().max() > 0
    save_slot_state(trainer, 2, tmp_path / "state")
    meta = json.loads((tmp_path / "state" / "slot_state.json").read_text())
    assert meta["hyper"]["targets"] == ["mlp", "unembed"]
    trainer.swap.swap_out(2, "k2")
    trainer.swap.swap_in(2, "k2")
    after_swap = weights(trainer, 2)
    trainer.clear_slot(2)
    load_slot_state(trainer, 2, tmp_path / "state")
    after_load = weights(trainer, 2)
    for got in (after_swap, after_load):
        for kind in before:
            for side in (0, 1):
                assert set(got[kind][side]) == set(before[kind][side])
                assert all(torch.equal(got[kind][side][k], before[kind][side][k]) for k in before[kind][side]), kind
    assert "decoder.layers.0.self_attention.linear_qkv" not in before["weight"][0]  # attention is off for slot 2


def test_untied_output_layer(tiny_world, tmp_path):
    """A base whose lm_head is its own weight (Qwen3-8B's case; the tiny world ties it): the tiny
    model with a separate, different lm_head. The trainer's unembedding LoRA wraps Megatron's own
    output weight there; trained, exported and loaded by HF + peft it gives the trainer's logits
    and chunked log-probs."""
    from transformers import AutoModelForCausalLM

    from tests.trainer_probes import forward_logits

    hf = AutoModelForCausalLM.from_pretrained(tiny_world / "model", dtype=torch.float32)
    hf.config.tie_word_embeddings = False
    untied = AutoModelForCausalLM.from_config(hf.config)
    untied.load_state_dict(hf.state_dict(), strict=False)
    with torch.no_grad():
        untied.lm_head.weight.copy_(hf.lm_head.weight + 0.05 * torch.randn_like(hf.lm_head.weight,
                                                                             generator=torch.Generator().manual_seed(3)))
    untied.save_pretrained(tmp_path / "untied")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tiny_world / "model" / f).exists():
            (tmp_path / "untied" / f).write_bytes((tiny_world / "model" / f).read_bytes())
    (tmp_path / "untied").rename(tmp_path / "model")
    trainer = make_trainer(tmp_path)  # base_model_path: tmp_path / "model"
    assert not trainer.base.model.share_embeddings_and_output_weights
    train_scenario(trainer)
    ids = torch.randint(0, 400, (2, 13), generator=torch.Generator().manual_seed(8))
    for slot in (0, 1):  # attention + MLP + lm_head; lm_head alone
        folder = trainer.export.export_peft(slot, tmp_path / f"slot{slot}")
        model = hf_peft(AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32), folder)
        with torch.no_grad():
            ref = model(ids).logits
        assert (forward_logits(trainer, ids, slot) - ref).abs().max().item() <= TOL, slot
        seqs = ids.tolist()
        targets = [s[1:] + [s[0]] for s in seqs]
        lp = trainer.packed_lora_pass(seqs, [slot, slot], targets)
        ref_lp = torch.log_softmax(ref.float(), -1).gather(-1, torch.tensor(targets).unsqueeze(-1)).reshape(-1)
        assert (lp - ref_lp).abs().max().item() <= TOL, slot
