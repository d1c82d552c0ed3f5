"""The Tinker API on a job whose trainer has two data-parallel ranks (issue 41 item 3): a live
`lorafleet serve` (real CLI process, two Ray trainer actors over gloo, one SGLang CPU engine, REST
with a token) on the tiny world with `placement.trainer.data_parallel: 2` and a keys file; one
service for the module.

The official SDK's model, beside a dataset-driven SFT run registered over REST (so its calls ride
in the loop's rounds with the run's samples, shared over both ranks):
* its first ``forward`` (the LoRA's B is zero, so the model is the base) answers every datum, each
  datum's logprobs and the call's ``loss:sum`` equal to HF transformers on the base model: the
  datums computed on either rank all come back, counted once;
* ``forward_backward`` + ``optim_step`` train it: the loss falls, the run keeps stepping, and the
  model's calls joined the run's rounds.
The two-rank numerics (dp=2 against dp=1 and HF+peft+AdamW, with planted bugs) are
tests/integration/test_tinker_dp.py's.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from tests.integration.sdk_clients import close_sdk_clients, open_client, unload_model  # noqa: F401 - autouse fixture
from tests.integration.test_tinker_sdk import train
from tests.integration.service_world import TOKEN, UNTIL_RETIRED, Service, fleet_pids, prometheus_text, serve_job, serving, sft, wait_for

pytestmark = pytest.mark.integration

KEYS = {"carol": "tml-carol-dp-key-7"}
BASE = "model"  # the served base model's name: its folder's name
N_DATUMS = 5  # odd: the two ranks' shares are uneven


@pytest.fixture(scope="module")
def service(tiny_world, tmp_path_factory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("tinker-serve-dp")
    job_path = serve_job(tmp, tiny_world, slots={"num_slots": 4, "max_rank": 8, "evict_idle_s": 3600.0}, keys=KEYS,
                         service={"tinker_window_ms": 50, "tinker_max_seq_len": 128})
    job = yaml.safe_load(job_path.read_text())
    job["placement"]["trainer"]["data_parallel"] = 2
    job_path.write_text(yaml.safe_dump(job))
    with serving(Service(job_path, tmp / "state", tmp / "serve.log")) as svc:
        yield svc


def sft_rows(tiny_world: Path, n: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(model_input, target_tokens, weights) of the first ``n`` echo rows: prompt + completion, the completion weighted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_world / "model")
    rows = []
    for line in (tiny_world / "data" / "echo_sft.jsonl").read_text().splitlines()[:n]:
        r = json.loads(line)
        p, c = tok.encode(r["prompt"]), tok.encode(r["completion"])
        full = p + c
        rows.append((full[:-1], full[1:], [0.0] * (len(p) - 1) + [1.0] * len(c)))
    return rows


def hf_base_outputs(hf_model, rows) -> list[tuple[torch.Tensor, float]]:
    """Per row: the base model's logprob of each target and the row's weighted cross-entropy sum (HF)."""
    out = []
    with torch.no_grad():
        for tokens, targets, weights in rows:
            logits = hf_model(torch.tensor(tokens)[None]).logits[0]
            lp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]
            out.append((lp.float(), float(-(lp * torch.tensor(weights, dtype=torch.float64)).sum())))
    return out


def test_two_rank_trainer_serves_and_trains_a_tinker_model(service, tiny_world, hf_model):
    from tinker import types

    rows = sft_rows(tiny_world, N_DATUMS)
    data = [types.Datum(model_input=types.ModelInput.from_ints(t), loss_fn_inputs={"target_tokens": y, "weights": w})
            for t, y, w in rows]
    with service.client() as rest:
        assert len(fleet_pids(rest, "trainer")) == 2  # two trainer ranks, one per data-parallel group
        model_id = None
        try:
            rest.register("dp-sft", sft(tiny_world, num_step=UNTIL_RETIRED))  # trains until retired
            wait_for(rest, "dp-sft", lambda r: r["state"] == "ACTIVE" and r["step"] >= 1, "first step")
            tc = open_client(service.url, KEYS["carol"]).create_lora_training_client(
                base_model=BASE, rank=4, seed=1, train_unembed=False).result()
            model_id = tc.model_id

            # the first forward: the base model's outputs for every datum, whichever rank computed it
            fwd = tc.forward(data, "cross_entropy").result()
            ref = hf_base_outputs(hf_model, rows)
            assert len(fwd.loss_fn_outputs) == N_DATUMS
            for out, (lp, _), (tokens, _, _) in zip(fwd.loss_fn_outputs, ref, rows):
                got = out["logprobs"].to_torch()
                assert got.shape == (len(tokens),) and torch.allclose(got, lp, atol=1e-4, rtol=0), (got - lp).abs().max()
            total = sum(loss for _, loss in ref)
            assert fwd.metrics["loss:sum"] == pytest.approx(total, rel=1e-5), (fwd.metrics, total)

            step_before = rest.get("dp-sft")["step"]
            losses = train(tc, data, 10, {"learning_rate": 5e-3})  # forward_backward + optim_step each
            assert losses[0] == pytest.approx(total, rel=1e-5)  # no step before it: the base still
            assert losses[-1] < 0.9 * losses[0] and max(losses[-3:]) < min(losses[:3]), losses
            wait_for(rest, "dp-sft", lambda r: r["step"] > step_before, "a step during the Tinker loop", timeout_s=120)
            metrics = prometheus_text(rest)
            joined = float(re.search(r"^lorafleet_tinker_joined_steps (\S+)$", metrics, re.M).group(1))
            assert joined > 0, metrics  # the model's calls rode in the run's rounds
            print(f"dp=2 service: first forward loss:sum {fwd.metrics['loss:sum']:.4f} vs HF {total:.4f}; "
                  f"Tinker losses {losses[0]:.3f} -> {losses[-1]:.3f}; joined steps {joined:g}")
            rest.retire("dp-sft")
            wait_for(rest, "dp-sft", lambda r: r["state"] == "COMPLETED", "COMPLETED", timeout_s=180)
        finally:
            if model_id is not None:
                with contextlib.suppress(Exception):
                    unload_model(service.url, KEYS["carol"], model_id)
            with contextlib.suppress(Exception):
                if rest.get("dp-sft")["state"] in ("PENDING", "ACTIVE"):
                    rest.retire("dp-sft")
    with httpx.Client(base_url=service.url, timeout=30, headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        assert http.get("/ready").json()["slots"]["free"] == 4  # the model's and the run's slots are back
