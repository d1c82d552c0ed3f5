"""The Tinker sampler's option handling (api/tinker/sampling/sampler.py) without a server: per-sample
seeds and the SDK's top-k layout. The deterministic engine is a FAKE (``DeterministicEngine``:
answers only get_server_info) because the CPU SGLang server cannot be started with
--enable-deterministic-inference; the real server's side is tests/integration/
test_tinker_sampling.py (refusal on CPU) and tests/gpu/test_tinker_seed_gpu.py (same seed ->
same samples on the GPU)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from api.tinker.sampling.sampler import MAX_TOPK, SEED_SPACE, LogprobOptions, SglangSampler, _fill_topk

pytestmark = pytest.mark.unit


class DeterministicEngine:
    """FAKE engine (a SamplerEngine's two fields: what it learned, and its client): only the server-info
    answer of a server with or without deterministic inference."""

    def __init__(self, deterministic: bool) -> None:
        self.flag = deterministic
        self.deterministic: bool | None = None  # not asked yet
        self.client = self
        self.asked = 0

    async def server_info(self) -> dict:
        self.asked += 1
        return {"enable_deterministic_inference": self.flag}


def test_seeds_per_sample():
    det, plain = DeterministicEngine(True), DeterministicEngine(False)
    s = SglangSampler("http://unused")
    assert asyncio.run(s.seeds(det, 7, 3)) == [7, 8, 9]
    assert asyncio.run(s.seeds(det, SEED_SPACE - 1, 2)) == [SEED_SPACE - 1, 0]  # stays a signed 64-bit seed
    fresh = asyncio.run(s.seeds(det, None, 4))
    assert len(set(fresh)) == 4 and all(0 <= x < SEED_SPACE for x in fresh)
    assert det.asked == 1  # asked once per engine
    with pytest.raises(ValueError, match="must be an integer"):
        asyncio.run(s.seeds(det, "7", 1))
    other = SglangSampler("http://unused")
    assert asyncio.run(other.seeds(plain, None, 2)) == [None, None]  # unseeded: the engine's own randomness
    with pytest.raises(ValueError, match="enable-deterministic-inference"):
        asyncio.run(other.seeds(plain, 7, 1))


def test_topk_layout_and_limits():
    from tinker.proto import tinker_public_pb2 as pb

    msg = pb.SampleResponse()
    _fill_topk(msg.topk_prompt_logprobs, [None, [(5, -0.1), (6, -2.0)], [(7, -0.5)]], 4, 2, 1)
    t = msg.topk_prompt_logprobs
    ids = np.frombuffer(t.token_ids, dtype=np.int32).reshape(t.length, t.k)
    lps = np.frombuffer(t.logprobs, dtype=np.float32).reshape(t.length, t.k)
    assert ids.tolist() == [[0, 0], [0, 0], [5, 6], [7, 0]]  # start 1: SGLang's lists begin at position 1
    assert lps[2].tolist() == pytest.approx([-0.1, -2.0]) and lps[3, 1] == -99999.0 and lps[0, 0] == -99999.0
    # last 3 of 10: SGLang's lists begin one before the first scored position (it scores none at its start)
    assert LogprobOptions(prompt_logprobs=True, last_n=3).start(10) == 6 and LogprobOptions().start(10) == -1
    assert LogprobOptions(prompt_logprobs=True, last_n=3).first_scored(10) == 7
    msg2 = pb.SampleResponse()
    _fill_topk(msg2.topk_prompt_logprobs, [[(1, -1.0)], [(2, -2.0)], [(3, -3.0)]], 4, 1, 1, keep=2)
    assert np.frombuffer(msg2.topk_prompt_logprobs.token_ids, dtype=np.int32).tolist() == [0, 0, 2, 3]
    with pytest.raises(ValueError, match=rf"topk_sample_logprobs={MAX_TOPK + 1} not supported"):
        LogprobOptions(topk_sample=MAX_TOPK + 1).check(5)
    with pytest.raises(ValueError, match="prompt_logprobs_last_n=6 not supported: 1..5"):
        LogprobOptions(prompt_logprobs=True, last_n=6).check(5)
