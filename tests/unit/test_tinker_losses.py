"""trainer/losses/table.py's Tinker losses against tests/reference/losses.py (written from Tinker's docs):
per-position values, gradients (autograd of ours against the reference's written-out derivative),
the documented defaults, and every config key moved off its default at least once, on data that
puts tokens on both sides of each clip bound and inside it."""

from __future__ import annotations

import pytest
import torch

from tests.reference.losses import TINKER_DEFAULTS, TINKER_INPUTS, tinker_token_grad, tinker_token_loss

pytestmark = pytest.mark.unit

# Per-position ratios r = exp(lp - q) and advantages: every case of the clip, for both defaults
# (0.8, 1.2) and the moved bounds below. A > 0 above hi and A < 0 below lo are clipped; A > 0 below
# lo and A < 0 above hi are not; 0.97 and 1.1 move in or out when a bound moves; A = 0 positions
# (a prompt) contribute nothing.
RATIOS = [1.5, 1.1, 0.5, 0.9, 1.0, 0.5, 1.5, 0.97, 1.1, 1.3]
ADV = [2.0, -1.0, -2.0, 1.0, 0.5, 1.0, -1.0, -1.5, 0.7, 0.0]
Q = [-1.2, -0.4, -2.5, -0.9, -3.0, -1.1, -0.2, -0.6, -1.7, -0.8]


def datum(ratios=RATIOS, adv=ADV, q=Q, mask=None):
    """lp [N] (leaf, requires grad) and the loss_fn_inputs that give these ratios."""
    q = torch.tensor(q, dtype=torch.float32)
    lp = (q + torch.log(torch.tensor(ratios, dtype=torch.float32))).requires_grad_(True)
    n = len(ratios)
    inp = {"target_tokens": torch.arange(n), "logprobs": q, "advantages": torch.tensor(adv, dtype=torch.float32),
           "weights": torch.linspace(0.0, 2.0, n), "sequence_ratio_mask": torch.tensor(mask or [1.0] * n)}
    return lp, inp


def ours(loss_fn, cfg, lp, inp):
    from trainer.losses.table import resolve_loss

    spec, full = resolve_loss(loss_fn, cfg)
    inputs = {k: v for k, v in inp.items() if k in spec.inputs}
    loss = spec.fn(lp, inputs, full).loss
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    return loss.detach(), grad


# (loss_fn, config) for every loss, each config key moved off its default alone
CASES = [
    ("cross_entropy", None), ("importance_sampling", None),
    ("ppo", None), ("ppo", {"clip_low_threshold": 0.95}), ("ppo", {"clip_high_threshold": 1.05}),
    ("cispo", None), ("cispo", {"clip_low_threshold": 0.95}), ("cispo", {"clip_high_threshold": 1.05}),
    ("dro", {"beta": 0.1}), ("dro", {"beta": 2.0}),
]


@pytest.mark.parametrize("loss_fn, cfg", CASES)
def test_values_and_gradients_equal_the_definitions(loss_fn, cfg):
    lp, inp = datum()
    loss, grad = ours(loss_fn, cfg, lp, inp)
    want = tinker_token_loss(loss_fn, cfg, lp, inp).detach()
    assert torch.allclose(loss, want, rtol=1e-6, atol=1e-6), (loss, want)
    assert torch.allclose(grad, tinker_token_grad(loss_fn, cfg, lp, inp), rtol=1e-6, atol=1e-6), grad
    # the reference's own derivative is the derivative of its own value (its two halves agree)
    (ref_grad,) = torch.autograd.grad(tinker_token_loss(loss_fn, cfg, lp, inp).sum(), lp)
    assert torch.allclose(ref_grad, tinker_token_grad(loss_fn, cfg, lp, inp), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("loss_fn, key, value", [
    ("ppo", "clip_low_threshold", 0.95), ("ppo", "clip_high_threshold", 1.05),
    ("cispo", "clip_low_threshold", 0.95), ("cispo", "clip_high_threshold", 1.05),
    ("gspo", "clip_low_threshold", 0.95), ("gspo", "clip_high_threshold", 1.05), ("dro", "beta", 2.0),
])
def test_each_config_key_changes_the_loss(loss_fn, key, value):
    """Moving one key off its default changes the reference's loss or gradient on this data, so the
    cases above would see a loss that ignores the key."""
    base = {"dro": {"beta": 0.1}}.get(loss_fn)
    if loss_fn == "gspo":  # s = 0.85 (0.8 < s < 0.95) or 1.15 (1.05 < s < 1.2): clipped only when moved
        s = 0.85 if key == "clip_low_threshold" else 1.15
        lp, inp = datum([s] * 4, [1.0, -1.0, 0.5, -0.5], Q[:4])
    else:
        lp, inp = datum()
    moved = {**(base or {}), key: value}
    a = (tinker_token_loss(loss_fn, base, lp, inp).detach(), tinker_token_grad(loss_fn, base, lp, inp))
    b = (tinker_token_loss(loss_fn, moved, lp, inp).detach(), tinker_token_grad(loss_fn, moved, lp, inp))
    assert not (torch.allclose(a[0], b[0]) and torch.allclose(a[1], b[1]))
    loss, grad = ours(loss_fn, moved, lp, inp)
    assert torch.allclose(loss, b[0], atol=1e-6) and torch.allclose(grad, b[1], atol=1e-6)


def test_the_documented_defaults():
    from trainer.losses.table import LOSSES, resolve_loss

    # stable_reinforce is lorafleet's own definition (Tinker publishes no formula nor defaults):
    # tests/reference/test_stable_reinforce.py holds it to its stated defaults
    assert set(LOSSES) - {"stable_reinforce"} == set(TINKER_DEFAULTS)
    for loss_fn, defaults in TINKER_DEFAULTS.items():
        assert LOSSES[loss_fn].inputs == TINKER_INPUTS[loss_fn]
        assert LOSSES[loss_fn].config == defaults, loss_fn
        if None not in defaults.values():
            assert resolve_loss(loss_fn, None)[1] == defaults


# -- gspo ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [None, {"clip_low_threshold": 0.95}, {"clip_high_threshold": 1.05}])
def test_gspo_values_and_gradients(cfg):
    """Two prompt positions (mask 0, A 0) and six sampled ones with per-token advantages of both
    signs; sequences whose mean log-ratio puts s above, inside and below the bounds."""
    mask = [0, 0, 1, 1, 1, 1, 1, 1]
    adv = [0.0, 0.0, 1.0, -1.0, 0.5, -2.0, 1.5, 0.3]
    for ratios in ([2.0, 0.3, 1.4, 1.3, 1.2, 1.5, 1.1, 1.4],  # s = 1.31: above 1.2
                   [0.5, 3.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0],  # s = 0.999: inside
                   [1.0, 1.0, 0.7, 0.8, 0.75, 0.6, 0.9, 0.7]):  # s = 0.736: below 0.8
        lp, inp = datum(ratios, adv, Q[:8], mask)
        loss, grad = ours("gspo", cfg, lp, inp)
        assert torch.allclose(loss, tinker_token_loss("gspo", cfg, lp, inp).detach(), rtol=1e-6, atol=1e-6)
        assert torch.allclose(grad, tinker_token_grad("gspo", cfg, lp, inp), rtol=1e-6, atol=1e-6), grad


def test_gspo_clips_whole_sequences_and_averages_over_the_mask_only():
    """s = geometric mean of the marked ratios: the unmarked positions' ratios (0.01 and 50) do not
    enter it. Above hi with A > 0, every marked position is clipped at once (no gradient); the same
    ratios with A < 0 are not clipped, and each position's gradient is -s A (not its own ratio)."""
    ratios, mask = [0.01, 50.0, 1.3, 1.3, 1.3], [0, 0, 1, 1, 1]
    lp, inp = datum(ratios, [0.0, 0.0, 1.0, 2.0, 0.5], Q[:5], mask)
    loss, grad = ours("gspo", None, lp, inp)
    assert loss.tolist() == pytest.approx([0.0, 0.0, -1.2, -2.4, -0.6], rel=1e-5)
    assert grad.tolist() == [0.0] * 5
    lp, inp = datum([0.01, 50.0, 1.5, 1.3, 1.0 * 1.3**3 / (1.5 * 1.3)], [0.0, 0.0, -1.0, -2.0, -0.5], Q[:5], mask)
    _, grad = ours("gspo", None, lp, inp)  # the same s = 1.3, ratios of their own
    assert grad.tolist() == pytest.approx([0.0, 0.0, 1.3, 2.6, 0.65], rel=1e-5)


def test_gspo_needs_a_marked_position():
    from trainer.losses.table import LOSSES, check_inputs

    lp, inp = datum(mask=[0.0] * len(RATIOS))
    inputs = {k: v for k, v in inp.items() if k in LOSSES["gspo"].inputs}
    with pytest.raises(ValueError, match=r"sequence_ratio_mask'\] marks no position"):
        check_inputs("gspo", LOSSES["gspo"], len(RATIOS), inputs)
    with pytest.raises(ValueError, match=r"lacks \['sequence_ratio_mask'\]"):
        check_inputs("gspo", LOSSES["gspo"], len(RATIOS), {k: v for k, v in inputs.items() if k != "sequence_ratio_mask"})


# -- the one clip: the REST runs' offsets become the same bounds -----------------------------------------


def test_rest_offsets_are_converted_once_to_the_bounds_the_tinker_ppo_uses():
    """A REST slot with clip_low 0.2 / clip_high 0.3 clips exactly as Tinker's ppo with thresholds
    0.8 / 1.3: the same token losses and gradients from the two faces of the one definition."""
    from trainer.config import SlotHyperParams
    from trainer.losses.rows import RowLoss, TokenLossInputs, row_token_losses

    h = SlotHyperParams(clip_low=0.2, clip_high=0.3)
    assert h.ratio_bounds == pytest.approx((0.8, 1.3))
    lp, inp = datum(RATIOS[:-1] + [1.35], adv=[1.0] * len(RATIOS))  # no ratio on a bound (a tie splits the gradient)
    rest_lp = lp.detach().clone()[None].requires_grad_(True)
    rest = TokenLossInputs(
        logprobs=rest_lp, mask=torch.ones_like(rest_lp, dtype=torch.bool), losses=[RowLoss.of(*h.loss_choice)],
        advantage=torch.tensor([1.0]), rollout_logprobs=inp["logprobs"][None],
        kl_coef=torch.zeros(1), ref_logprobs=None, per_token_weight=torch.ones(1))
    rest_loss = row_token_losses(rest)[0]
    (rest_grad,) = torch.autograd.grad(rest_loss.sum(), rest_lp)
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.3}
    loss, grad = ours("ppo", cfg, lp, inp)
    assert torch.allclose(rest_loss[0].detach(), loss) and torch.allclose(rest_grad[0], grad)
    assert torch.allclose(loss, tinker_token_loss("ppo", cfg, lp, inp).detach(), atol=1e-6)


# -- refusals --------------------------------------------------------------------------------------------


def test_custom_is_not_an_entry_and_is_refused_with_what_is_served():
    """A custom loss is named by its loss_id in a Tinker call (trainer/step/custom_calls.py), never by a table
    lookup: a dataset run naming "custom" is refused with what it can name."""
    from trainer.losses.table import resolve_loss

    with pytest.raises(ValueError, match=r"named by its loss_id in a Tinker forward_backward; a dataset run cannot name one; "
                                         r"supported: \['cispo', "
                                         r"'cross_entropy', 'dro', 'gspo', 'importance_sampling', 'ppo', 'stable_reinforce'\]"):
        resolve_loss("custom", None)
    with pytest.raises(ValueError, match=r"keys \['kl'\] are not known to 'gspo'; allowed: \['clip_high_threshold', "
                                         r"'clip_low_threshold'\]"):
        resolve_loss("gspo", {"kl": 1.0})
    with pytest.raises(ValueError, match="need 0 <= clip_low_threshold <= clip_high_threshold"):
        resolve_loss("gspo", {"clip_low_threshold": 1.3})
