"""A Tinker tenant for the multi-node drills (tests/integration/test_multinode.py): the official SDK
against the module's live service, with the SL loop its models run and greedy sampling.

The loop's step (`train`): forward_backward on the first half of the rows, waited; then
forward_backward on the second half and optim_step, sent together and waited. Between the halves
the model holds a pending gradient (the first half's) that no snapshot covers yet: a trainer lost
there must replay that call from the model's journal (service/tenants/tinker_model.py M6) for the
losses to go on as they would have without the loss. `between(step)` runs there (the drill's kill).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

KEY = "tml-multinode-carol-key-5"
TENANT = "carol"
BASE = "model"  # the served base model's name: its folder's name (tiny world: .cache/tiny/model)
SEED = 11  # the LoRA init seed of every model of the drills: same seed, same rows, same steps = same run
ADAM = {"learning_rate": 2e-2}  # large enough that two steps change the greedy continuations
ROWS = 8  # echo rows, two halves of 4
MAX_TOKENS = 10  # greedy tokens sampled per prompt
CALL_TIMEOUT_S = 1500.0  # a call waits through a node's loss (the trainer placed anew, a run's re-preparation)


def halves(tiny_world: Path) -> tuple[list, list]:
    """The first ROWS echo rows as SDK datums (prompt + completion, the completion weighted), in two halves."""
    from tinker import types

    from tests.integration.test_tinker_serve_dp import sft_rows

    data = [types.Datum(model_input=types.ModelInput.from_ints(t), loss_fn_inputs={"target_tokens": y, "weights": w})
            for t, y, w in sft_rows(tiny_world, ROWS)]
    return data[: ROWS // 2], data[ROWS // 2:]


def train(tc, data: tuple[list, list], steps: Iterable[int], between: Callable[[int], None] = lambda step: None) -> list[float]:  # tc: an SDK TrainingClient
    """The loop (module doc) for `steps`; the loss:sum of every forward_backward, in order."""
    from tinker import types

    first, second = data
    losses = []
    for step in steps:
        losses.append(tc.forward_backward(first, "cross_entropy").result(CALL_TIMEOUT_S).metrics["loss:sum"])
        between(step)
        fb = tc.forward_backward(second, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(**ADAM))
        losses.append(fb.result(CALL_TIMEOUT_S).metrics["loss:sum"])
        opt.result(CALL_TIMEOUT_S)
    return losses


def prompts(tiny_world: Path, n: int = 2) -> list[list[int]]:
    """Prompts the models never trained on (echo rows after the training rows), tokenized."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_world / "model")
    rows = (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()[ROWS: ROWS + n]
    return [tok.encode(json.loads(r)["prompt"]) for r in rows]


def sample_future(sampler, prompt: list[int], max_tokens: int = MAX_TOKENS):  # an SDK SamplingClient; its future
    from tinker import types

    return sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=max_tokens, temperature=0.0))


def greedy(sampler, prompt_ids: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:  # an SDK SamplingClient
    """Each prompt's greedy continuation from the service's engines (it stops at EOS)."""
    return [list(sample_future(sampler, p, max_tokens).result(CALL_TIMEOUT_S).sequences[0].tokens) for p in prompt_ids]


def agrees(got: list[int], ref: list[int]) -> bool:
    """An engine's greedy tokens against HF's (which do not stop at EOS, token 0 in the tiny world): a prefix."""
    return got == ref[: len(got)] and (len(got) == len(ref) or got[-1] == 0)
