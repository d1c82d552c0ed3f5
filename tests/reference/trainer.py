"""One LoRA adapter trained the plain way: Hugging Face model + peft, torch.optim.AdamW,
torch.nn.utils.clip_grad_norm_, torch.optim.lr_scheduler.LambdaLR, one sample at a time.

Nothing here imports lorafleet's trainer code. lorafleet's hyper-parameter record
(``SlotHyperParams``) is read only as a description of what to do (its fields), and
``TrainSample`` as the wire record of a sample.

The one structural choice taken from lorafleet's design (DESIGN.md, trainer/export/peft_io.py
doc): LoRA on a *fused* Megatron projection (q/k/v, gate/up) has ONE ``lora_A`` feeding
the fused output. In peft's unfused Hugging Face modules that is the same ``lora_A``
parameter shared by q_proj, k_proj and v_proj (and by gate_proj and up_proj): the
reference ties those parameters, so each gets the summed gradient of its three (two)
uses and is counted once by the optimizer, the clipping norm and weight decay.

Token alignment (trainer/batch.py's wire convention): ``loss_mask[t] = 1`` means token t
is learned, predicted from tokens[:t]; ``rollout_logprobs[t]`` is its log-probability
under the policy that generated it.

Targets (``hyper.targets``, read as a description): attention is PEFT's q/k/v/o_proj, mlp its
gate/up/down_proj, unembed its ``lm_head``: peft wraps the output projection in a LoRA Linear, so
the logits are lm_head(x) + scale * B A x. The tiny model ties lm_head to the input embedding;
peft's LoRA sits on the lm_head module only (the embedding lookup is untouched), and the tied
base weight stays frozen.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from tests.reference.losses import k3_kl, normalize_step, ppo_clip_token_loss, sft_token_loss

HF_TARGETS_OF = {"attention": ["q_proj", "k_proj", "v_proj", "o_proj"], "mlp": ["gate_proj", "up_proj", "down_proj"],
                 "unembed": ["lm_head"]}


def hf_targets(hyper) -> list[str]:  # noqa: ANN001 - SlotHyperParams
    """PEFT target_modules for the adapter's target groups (default: attention and MLP)."""
    return [m for group in getattr(hyper, "targets", ("attention", "mlp")) for m in HF_TARGETS_OF[group]]
TIED_A = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def lr_factor(hyper, update: int) -> float:  # noqa: ANN001 - SlotHyperParams
    """Multiplier of the peak lr for update number ``update`` (1-based), as documented for
    lorafleet's slots: linear warm-up lr * k / W for k <= W, then constant, or a half cosine
    from lr to min_lr_ratio * lr reached at total_steps and held after."""
    w = hyper.warmup_steps
    if w and update <= w:
        return update / w
    if hyper.lr_schedule == "constant":
        return 1.0
    progress = min((update - w) / (hyper.total_steps - w), 1.0)
    m = hyper.min_lr_ratio
    return m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress))


class ReferenceAdapter:
    """One adapter on its own copy of the base model."""

    def __init__(self, model_dir: str | Path, hyper, init: dict[str, torch.Tensor]):  # noqa: ANN001
        """``init``: PEFT-named tensors (``base_model.model.<module>.lora_{A,B}.weight``)."""
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        self.hyper = hyper
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        cfg = LoraConfig(r=hyper.rank, lora_alpha=hyper.alpha, target_modules=hf_targets(hyper), lora_dropout=0.0,
                         bias="none")
        self.model = get_peft_model(base, cfg)
        self.model.train()  # no dropout anywhere in the tiny model; train() for form's sake
        self.lora_modules = {name: m for name, m in self.model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}
        self._tie_fused_a()
        self.load(init)
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # unique (tied counted once)
        self.optimizer = torch.optim.AdamW(self.params, lr=hyper.lr, betas=tuple(hyper.betas), eps=hyper.eps,
                                           weight_decay=hyper.weight_decay)
        # LambdaLR's factor i is used by the (i+1)-th optimizer.step().
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda i: lr_factor(hyper, i + 1))
        self.updates = 0

    def _tie_fused_a(self) -> None:
        for name, module in list(self.lora_modules.items()):
            parent, _, leaf = name.rpartition(".")
            group = TIED_A.get(parent.rpartition(".")[2])
            if group and leaf != group[0] and leaf in group:
                first = self.lora_modules[f"{parent}.{group[0]}"]
                module.lora_A["default"].weight = first.lora_A["default"].weight

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        expected = set(self.state().keys())
        if set(tensors) != expected:
            raise ValueError(f"tensor names differ: missing {sorted(expected - set(tensors))[:3]}, "
                             f"extra {sorted(set(tensors) - expected)[:3]}")
        for name, m in self.lora_modules.items():
            m.lora_A["default"].weight.copy_(tensors[f"{name}.lora_A.weight"])
            m.lora_B["default"].weight.copy_(tensors[f"{name}.lora_B.weight"])
        for name, m in self.lora_modules.items():  # tied A's must have come in equal
            assert torch.equal(m.lora_A["default"].weight, tensors[f"{name}.lora_A.weight"]), name

    def state(self) -> dict[str, torch.Tensor]:
        """PEFT-named weights (what lorafleet's peft_tensors returns)."""
        out = {}
        for name, m in self.lora_modules.items():
            out[f"{name}.lora_A.weight"] = m.lora_A["default"].weight.detach().clone()
            out[f"{name}.lora_B.weight"] = m.lora_B["default"].weight.detach().clone()
        return out

    def moments(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """AdamW's (exp_avg, exp_avg_sq) per PEFT name (tied A's under each of their names)."""
        out = {}
        for name, m in self.lora_modules.items():
            for ab in ("lora_A", "lora_B"):
                st = self.optimizer.state.get(getattr(m, ab)["default"].weight, {})
                if st:
                    out[f"{name}.{ab}.weight"] = (st["exp_avg"].clone(), st["exp_avg_sq"].clone())
        return out

    def _token_logprobs(self, tokens: list[int], learned: list[int], adapter: bool = True) -> torch.Tensor:
        ids = torch.tensor(tokens).unsqueeze(0)
        if adapter:
            logits = self.model(input_ids=ids).logits[0]
        else:
            with self.model.disable_adapter(), torch.no_grad():
                logits = self.model(input_ids=ids).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        pos = torch.tensor(learned)
        return logp[pos - 1, ids[0, pos]]  # token t is predicted by the logits at t - 1

    def token_losses(self, sample) -> torch.Tensor:  # noqa: ANN001 - TrainSample
        h = self.hyper
        learned = [t for t, m in enumerate(sample.loss_mask) if m]
        logp = self._token_logprobs(sample.tokens, learned)
        if h.objective == "sft":
            return sft_token_loss(logp)
        if sample.rollout_logprobs is not None:
            old = torch.tensor([sample.rollout_logprobs[t] for t in learned], dtype=torch.float32)
        else:
            old = logp.detach()  # on-policy: ratio 1
        loss = ppo_clip_token_loss(logp, old, sample.advantage, h.clip_low, h.clip_high)
        if h.kl_coef > 0:
            ref = self._token_logprobs(sample.tokens, learned, adapter=False)
            loss = loss + h.kl_coef * k3_kl(logp, ref)
        return loss

    def step(self, samples: list) -> dict:
        """One optimizer update from exactly one step's samples: {loss, grad_norm, lr, update}."""
        if len(samples) != self.hyper.samples_per_step:
            raise ValueError(f"a step takes {self.hyper.samples_per_step} samples, got {len(samples)}")
        lr = self.optimizer.param_groups[0]["lr"]
        loss = normalize_step([self.token_losses(s) for s in samples], self.hyper.loss_normalization,
                              self.hyper.loss_norm_tokens)
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        max_norm = self.hyper.max_grad_norm if self.hyper.max_grad_norm is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.updates += 1
        return {"loss": float(loss.detach()), "grad_norm": float(grad_norm), "lr": lr, "update": self.updates}

    @torch.no_grad()
    def logprobs(self, tokens: list[int]) -> torch.Tensor:
        """Teacher-forced log p(token t | tokens[:t]) for t = 1..n-1 with the adapter on."""
        return self._token_logprobs(tokens, list(range(1, len(tokens))))


def train_alone(model_dir, hyper, init: dict[str, torch.Tensor], samples: list) -> tuple[ReferenceAdapter, list[dict]]:  # noqa: ANN001
    """The adapter's samples in arrival order, cut into consecutive steps of samples_per_step
    (a trailing partial step is left untrained); returns the adapter and one report per update."""
    ref = ReferenceAdapter(model_dir, hyper, init)
    n = hyper.samples_per_step
    reports = [ref.step(samples[i : i + n]) for i in range(0, len(samples) - n + 1, n)]
    return ref, reports
