"""A dataset run's micro-batch through the one loss table: rows [b, s], one per sample, each with
its slot's loss (trainer/losses/table.py), so one micro-batch mixes adapters that train with
different losses.

Row layout: token t's entries describe the prediction of token t + 1 (``logprobs[j, t]`` is log p of
that token under the policy, ``mask`` marks the loss positions, ``rollout_logprobs`` holds the
sampler's log-probability, or the policy's own, detached, where it is unknown: on-policy, ratio
exactly 1). A row hands the table every input an entry may take, built from the sample:
``weights`` = the mask, ``logprobs`` = the rollout log-probabilities, ``advantages`` = the
sample's advantage on its loss positions (0 elsewhere), ``sequence_ratio_mask`` = the mask, and
``sampled_sequence`` = the mask too (stable_reinforce: the row is one sampled sequence, id 1, and the
rollout's recorded log-probabilities are its sampler's: the server is its own sampler here).

Per row: the token loss of its entry, plus ``kl_coef`` times the k3 estimate of the KL to the
frozen base (LoRA off; GRPO eq. 4), masked to the loss positions, summed and multiplied by the
row's ``per_token_weight`` (1 / its loss tokens for ``sequence_mean``, else 1): the row's
*un-normalized* loss numerator. The per-slot normalizer (samples_per_step, the step's loss-token
count, or samples_per_step * loss_norm_tokens) is applied to the accumulated gradient when the slot
steps (trainer/config.py explains why this gives each adapter exactly its alone-gradient).

Masked positions are excluded with ``torch.where`` rather than multiplication, so that a
non-finite value at a pad cannot turn a sample's loss into NaN; and the per-token inputs are set
to 0 there *before* any arithmetic, so that such a value cannot turn the gradient into NaN either
(the backward of ``where`` multiplies the unselected branch's gradient by 0, and 0 * NaN from
``exp`` of a non-finite input would still be NaN).

Statistics per row (detached): its loss tokens, and over the loss positions of an rl row: the
tokens whose clip was active, the sum of the importance ratios exp(lp - q) and of the k3 KL.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trainer.losses.table import LOSSES, TokenLoss


@dataclass(frozen=True)
class RowLoss:
    """One row's loss: a table entry's name and its resolved config (trainer/losses/table.py resolve_loss)."""

    name: str
    config: tuple[tuple[str, float], ...] = ()  # sorted items: hashable, so rows group by it

    @staticmethod
    def of(name: str, config: dict[str, float] | None = None) -> "RowLoss":
        return RowLoss(name, tuple(sorted((config or {}).items())))

    @property
    def kind(self) -> str:
        return LOSSES[self.name].kind


@dataclass
class TokenLossInputs:
    logprobs: torch.Tensor  # [b, s] fp32, log p(label) under policy (LoRA on), requires grad
    mask: torch.Tensor  # [b, s] bool, loss positions
    losses: list[RowLoss]  # [b] each row's entry
    advantage: torch.Tensor  # [b] fp32
    rollout_logprobs: torch.Tensor  # [b, s] fp32 (policy logprobs at rollout; = logprobs.detach() if unknown)
    kl_coef: torch.Tensor  # [b]
    ref_logprobs: torch.Tensor | None  # [b, s] base logprobs (LoRA off), where any kl_coef > 0
    per_token_weight: torch.Tensor  # [b] (1/n_tokens for sequence_mean, else 1)

    @property
    def is_rl(self) -> torch.Tensor:
        """[b] bool: the rows whose entry is of the rl kind."""
        return torch.tensor([row.kind == "rl" for row in self.losses], device=self.mask.device)


@dataclass
class TokenLossStats:
    """Per-sample sums (detached) for metrics."""

    numerator: torch.Tensor  # [b] the weighted loss sum (what is back-propagated)
    tokens: torch.Tensor  # [b] loss tokens
    clipped: torch.Tensor  # [b] RL tokens whose clip was active
    ratio_sum: torch.Tensor  # [b]
    kl_sum: torch.Tensor  # [b] k3 KL estimate summed over tokens


def row_token_losses(inp: TokenLossInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token loss, ratio, clipped flag, k3 KL), all [b, s], for every position of every row.

    loss = the row's entry + kl_coef * KL, ratio = exp(logp - logp_rollout) (1 for sft rows),
    KL = exp(ref - logp) - (ref - logp) - 1 (k3, >= 0; 0 without a reference).
    Rows are evaluated in groups of the same entry and config, then put back in row order."""
    lp = inp.logprobs
    b = lp.shape[0]
    inputs = {
        "weights": inp.mask.to(lp.dtype),
        "logprobs": inp.rollout_logprobs,
        "advantages": inp.advantage.unsqueeze(1) * inp.mask.to(lp.dtype),
        "sequence_ratio_mask": inp.mask.to(lp.dtype),
        "sampled_sequence": inp.mask.to(lp.dtype),  # stable_reinforce: a row is one sampled sequence (id 1)
    }
    groups: dict[RowLoss, list[int]] = {}
    for j, row in enumerate(inp.losses):
        groups.setdefault(row, []).append(j)
    parts, flags, order = [], [], []
    for row, rows in groups.items():
        idx = torch.tensor(rows, device=lp.device)
        spec = LOSSES[row.name]
        out: TokenLoss = spec.fn(lp.index_select(0, idx), {k: v.index_select(0, idx) for k, v in inputs.items()},
                                 dict(row.config))
        parts.append(out.loss)
        flags.append(out.clipped if out.clipped is not None else torch.zeros_like(out.loss, dtype=torch.bool))
        order += rows
    inverse = torch.empty(b, dtype=torch.long)
    inverse[torch.tensor(order)] = torch.arange(b)
    inverse = inverse.to(lp.device)
    loss = torch.cat(parts).index_select(0, inverse)
    was_clipped = torch.cat(flags).index_select(0, inverse)
    is_rl = inp.is_rl.unsqueeze(1)
    ratio = torch.where(is_rl, torch.exp(lp.detach() - inp.rollout_logprobs), torch.ones_like(lp))
    if inp.ref_logprobs is not None:
        delta = inp.ref_logprobs - lp
        kl = torch.exp(delta) - delta - 1.0
        loss = loss + inp.kl_coef.unsqueeze(1) * kl
    else:
        kl = torch.zeros_like(loss)
    return loss, ratio, was_clipped, kl.detach()


def sample_loss_numerators(inp: TokenLossInputs) -> tuple[torch.Tensor, TokenLossStats]:
    """[b] weighted per-sample loss sums (differentiable) and their statistics."""
    inp = _zero_masked_positions(inp)
    token_loss, ratio, was_clipped, kl = row_token_losses(inp)
    token_loss = torch.where(inp.mask, token_loss, torch.zeros_like(token_loss))
    numerators = token_loss.sum(dim=1) * inp.per_token_weight
    rl_mask = inp.mask & inp.is_rl.unsqueeze(1)
    zero = torch.zeros_like(ratio)
    stats = TokenLossStats(
        numerator=numerators.detach(),
        tokens=inp.mask.sum(dim=1).to(torch.float32),
        clipped=(was_clipped & rl_mask).sum(dim=1).to(torch.float32),
        ratio_sum=torch.where(rl_mask, ratio, zero).sum(dim=1),
        kl_sum=torch.where(rl_mask, kl, zero).sum(dim=1),
    )
    return numerators, stats


def _zero_masked_positions(inp: TokenLossInputs) -> TokenLossInputs:
    """The per-token inputs with 0 at positions outside the mask (module doc: no NaN gradient)."""

    def keep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else torch.where(inp.mask, t, torch.zeros_like(t))

    return replace(inp, logprobs=keep(inp.logprobs), rollout_logprobs=keep(inp.rollout_logprobs),
                   ref_logprobs=keep(inp.ref_logprobs))
