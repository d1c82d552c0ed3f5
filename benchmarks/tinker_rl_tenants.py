"""Many Tinker RL tenants from one client process: the official SDK's futures awaited on one event loop.

Each tenant is one coroutine running the cookbook's RL loop (tinker_cookbook/recipes/rl_loop.py, with
importance_sampling as its loss) against a Tinker model of its own:

  1. ``save_weights_and_get_sampling_client()``  (a sampler checkpoint of the current weights, a session)
  2. ``sample(prompt, group, params)`` for each of the step's prompts, concurrently
  3. rewards (the tiny world's target_share of the decoded text), advantages centred in each group
  4. ``forward_backward(datums, "importance_sampling")`` and ``optim_step(adam)``, both sent before
     either is awaited (as the Tinker docs recommend)

Why one loop: thousands of tenants must not need thousands of threads on a 2-core machine. The SDK
already runs every request on its own single background loop (tinker.lib.internal_client_holder's
thread singleton); the tenants here only await its futures on the caller's loop, so the client is
two threads however many tenants there are. ServiceClients are shared per key (one session per key;
the SDK numbers a session's training clients), as tests/integration/test_service_scale.py does.

``CallLog`` keeps every call's (end time, seconds) by kind, so a measurement window takes the calls
that ended inside it: create, save_sampler (step 1), sample (one call of step 2), forward_backward,
optim_step, step (1-4 whole). It also keeps each finished step's sampled tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("create", "save_sampler", "sample", "forward_backward", "optim_step", "step")


@dataclass(frozen=True)
class RlWorkload:
    """What every tenant's step does: ``prompts_per_step`` prompts (token ids), ``group`` samples of each,
    ``max_tokens`` new tokens at ``temperature``; AdamW at ``learning_rate``. ``to_max_tokens``: every
    sample runs to ``max_tokens`` (``stop=[]``: past EOS), so every tenant-step samples the same tokens
    however far its adapter has trained; False stops at EOS, where the sampled length drifts as the
    tenants train (a window's rate then measures their lengths as much as the service)."""

    prompts: list[list[int]]
    labels: list[str]
    decode: Any  # token ids -> text (the tokenizer's decode)
    prompts_per_step: int = 2
    group: int = 4
    max_tokens: int = 12
    temperature: float = 1.0
    to_max_tokens: bool = True
    learning_rate: float = 1e-3
    rank: int = 8

    @staticmethod
    def from_tiny_world(world: Path, **over: Any) -> RlWorkload:
        """The tiny world's digits task: its prompts tokenized once (the tenants never tokenize)."""
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(world / "model")
        rows = [json.loads(line) for line in (world / "data" / "digits.jsonl").read_text().splitlines()]
        return RlWorkload(prompts=[tok.encode(r["prompt"]) for r in rows], labels=[r["label"] for r in rows],
                          decode=lambda ids: tok.decode(ids, skip_special_tokens=True), **over)


@dataclass
class CallLog:
    """Every finished call by kind: (monotonic end, seconds); finished steps: (end, sampled tokens)."""

    calls: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    steps: list[tuple[float, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, kind: str, started: float) -> None:
        now = time.monotonic()
        self.calls[kind].append((now, now - started))

    def window(self, t0: float, t1: float, creates_since: float | None = None) -> dict[str, Any]:
        """Steps, sampled tokens and each kind's latencies (p50, p99, count) of what ended in [t0, t1)
        (creations: in [creates_since, t1), the phase's, which mostly end before its window)."""
        out: dict[str, Any] = {"steps": sum(1 for t, _ in self.steps if t0 <= t < t1),
                               "sampled_tokens": sum(n for t, n in self.steps if t0 <= t < t1)}
        for kind in KINDS:
            since = creates_since if kind == "create" and creates_since is not None else t0
            xs = sorted(s for t, s in self.calls.get(kind, []) if since <= t < t1)
            if xs:
                out[f"{kind}_ms"] = {"p50": 1e3 * pct(xs, 0.5), "p99": 1e3 * pct(xs, 0.99), "n": len(xs)}
        return out


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of sorted ``xs`` (nearest rank)."""
    return xs[min(len(xs) - 1, max(0, round(q * len(xs)) - 1))] if xs else float("nan")


def _centred(rewards: list[float]) -> list[float]:
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def rl_datums(prompt: list[int], sequences: list, advantages: list[float]) -> list:
    """The cookbook's importance_sampling datums of one group: prompt + sampled tokens, shifted by one;
    the sampler's logprobs and the sequence's advantage on the sampled positions, 0 on the prompt's."""
    from tinker import types

    out = []
    for seq, adv in zip(sequences, advantages):
        tokens = list(seq.tokens)
        if not tokens:
            continue
        full = prompt + tokens
        pad = [0.0] * (len(prompt) - 1)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                               loss_fn_inputs={"target_tokens": full[1:], "logprobs": pad + list(seq.logprobs),
                                               "advantages": pad + [adv] * len(tokens)}))
    return out


async def timed(log: CallLog, kind: str, awaitable: Any, sent: float | None = None) -> Any:
    """``awaitable``'s result, its time from ``sent`` (default: now) logged as ``kind``."""
    t0 = time.monotonic() if sent is None else sent
    result = await awaitable
    log.add(kind, t0)
    return result


async def rl_step(tc: Any, work: RlWorkload, log: CallLog, step: int, salt: int) -> None:
    """One tenant-step (module doc, 1-4)."""
    from tinker import types

    from rollout.rewards import target_share

    t0 = time.monotonic()
    sampler = await timed(log, "save_sampler", tc.save_weights_and_get_sampling_client())
    params = types.SamplingParams(max_tokens=work.max_tokens, temperature=work.temperature, stop=[] if work.to_max_tokens else None)
    picks = [(salt + step * work.prompts_per_step + j) % len(work.prompts) for j in range(work.prompts_per_step)]
    groups = await asyncio.gather(*(timed(log, "sample", sampler.sample(types.ModelInput.from_ints(work.prompts[i]),
                                                                        work.group, params)) for i in picks))
    datums, sampled = [], 0
    for i, group in zip(picks, groups):
        rewards = [target_share(work.decode(list(s.tokens)), work.labels[i]) for s in group.sequences]
        sampled += sum(len(s.tokens) for s in group.sequences)
        datums += rl_datums(work.prompts[i], group.sequences, _centred(rewards))
    sent = time.monotonic()
    fb = tc.forward_backward(datums, "importance_sampling")
    opt = tc.optim_step(types.AdamParams(learning_rate=work.learning_rate))
    await timed(log, "forward_backward", fb, sent)
    await timed(log, "optim_step", opt, sent)  # from its sending: it runs in the round after the pass
    log.add("step", t0)
    log.steps.append((time.monotonic(), sampled))


@dataclass
class Tenant:
    index: int
    steps: int = 0
    model_id: str | None = None
    task: asyncio.Task | None = None
    paused: bool = False  # set by Fleet.shrink: finish the step in hand, unload the model, stop


async def run_tenant(t: Tenant, service_client: Any, base_model: str, work: RlWorkload, log: CallLog,
                     stop: asyncio.Event, unload: Any = None) -> None:
    """Create the tenant's model (it waits for a slot while every slot is taken), then RL steps until
    ``stop``, or until the tenant is paused: then ``await unload(model_id)``. A failure is logged and
    ends this tenant only."""
    try:
        tc = await timed(log, "create", service_client.create_lora_training_client(
            base_model=base_model, rank=work.rank, seed=t.index, train_unembed=False))
        t.model_id = tc.model_id
        while not stop.is_set() and not t.paused:
            await rl_step(tc, work, log, t.steps, t.index)
            t.steps += 1
        if t.paused and unload is not None:
            await unload(t.model_id)
    except Exception as err:  # noqa: BLE001 - reported by the benchmark, the others go on
        log.errors.append(f"tenant {t.index} ({t.model_id}): {type(err).__name__}: {err}")


async def unload_model(url: str, api_key: str, model_id: str) -> None:
    """unload_model over HTTP (what the SDK sends; SDK 0.38 has no call for it), its future awaited."""
    import httpx

    async with httpx.AsyncClient(base_url=url + "/api/v1", timeout=120, headers={"X-API-Key": api_key}) as http:
        rid = (await http.post("unload_model", json={"model_id": model_id})).raise_for_status().json()["request_id"]
        while True:
            body = (await http.post("retrieve_future", json={"request_id": rid})).raise_for_status().json()
            if body.get("type") != "try_again":
                break
    if body != {"type": "unload_model", "model_id": model_id}:
        raise RuntimeError(f"unload_model of {model_id}: {body}")


class Fleet:
    """The tenants of one client process, added in phases (`grow`), all stopped by `stop`."""

    def __init__(self, url: str, keys: list[str], base_model: str, work: RlWorkload) -> None:
        import tinker

        self.url, self.keys = url, keys
        self.clients = [tinker.ServiceClient(base_url=url, api_key=k) for k in keys]  # one per key (module doc)
        self.base_model = base_model
        self.work = work
        self.log = CallLog()
        self.tenants: list[Tenant] = []
        self.stopping = asyncio.Event()

    def grow(self, n: int) -> list[Tenant]:
        """Start tenants until there are ``n``; the new ones."""
        new = [Tenant(i) for i in range(len(self.tenants), n)]
        for t in new:
            client, key = self.clients[t.index % len(self.clients)], self.keys[t.index % len(self.keys)]
            t.task = asyncio.get_running_loop().create_task(run_tenant(
                t, client, self.base_model, self.work, self.log, self.stopping,
                unload=lambda model_id, key=key: unload_model(self.url, key, model_id)))
        self.tenants += new
        return new

    def active(self) -> list[Tenant]:
        """The tenants not paused."""
        return [t for t in self.tenants if not t.paused]

    async def until_stepped(self, tenants: list[Tenant], deadline_s: float, more_than: dict[int, int] | None = None) -> bool:
        """Wait until each of ``tenants`` finished a step (more steps than ``more_than[index]``, default 0)
        or failed; False at the deadline."""
        end = time.monotonic() + deadline_s
        floor = more_than or {}
        while any(t.steps <= floor.get(t.index, 0) and not t.task.done() for t in tenants):
            if time.monotonic() > end:
                return False
            await asyncio.sleep(1.0)
        return True

    async def shrink(self, n: int, deadline_s: float) -> list[Tenant]:
        """Pause the active tenants past the first ``n``: each finishes the step it is in (its calls may be
        queued for a turn), then unloads its model (which gives its slot back at once: a model that just
        goes quiet keeps its slot until it has idled `evict_idle_s`, an hour for 960 of them through 8
        slots). Returns those not finished by the deadline. Cancelling instead would leave their sent calls
        queued on the service, drained by later turns inside the next measurement."""
        going = self.active()[n:]
        for t in going:
            t.paused = True
        _, late = await asyncio.wait([t.task for t in going], timeout=deadline_s) if going else (set(), set())
        return [t for t in going if t.task in late]

    async def stop(self, timeout_s: float = 60.0) -> None:
        """Every tenant finishes the step it is in (those still in one after ``timeout_s`` are cancelled:
        with hundreds of tenants, one waiting for its turn may take minutes), then the sessions close."""
        self.stopping.set()
        _, late = await asyncio.wait([t.task for t in self.tenants], timeout=timeout_s)
        for task in late:
            task.cancel()
        for c in self.clients:
            with contextlib.suppress(Exception):  # the server may be gone already
                await c.close("success")


class FleetProcess:
    """The same tenants in a process of their own (``python -m benchmarks.tinker_rl_tenants``), for a
    benchmark that times other clients in its own interpreter (bench_scale_cpu's readers): hundreds of SDK
    tenants would otherwise share the GIL with the clocks it reads. The child prints its counts every
    0.5 s ("<steps> <tenants stepped> <errors>"); they are kept with this process's monotonic time."""

    def __init__(self, url: str, keys: list[str], base_model: str, tenants: int) -> None:
        import subprocess
        import sys
        import threading

        self.tenants = tenants
        self.counts: list[tuple[float, int, int]] = [(time.monotonic(), 0, 0)]  # (received, steps, stepped)
        self.errors: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.tinker_rl_tenants", url, base_model, str(tenants), *keys],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, name="tinker-tenants-counts", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("error "):
                self.errors.append(line[6:].strip())
            elif line.startswith("counts "):
                steps, stepped = (int(x) for x in line.split()[1:3])
                self.counts.append((time.monotonic(), steps, stepped))

    def until_stepped(self, deadline_s: float) -> bool:
        """Every tenant finished a step (False at the deadline, on an error, or when the child ended)."""
        end = time.monotonic() + deadline_s
        while self.counts[-1][2] < self.tenants:
            if time.monotonic() > end or self.errors or self.proc.poll() is not None:
                return False
            time.sleep(1.0)
        return True

    def steps_in(self, t0: float, t1: float) -> int:
        """Tenant-steps finished in [t0, t1): the counts last received before each end (0.5 s resolution)."""
        def at(t: float) -> int:
            return max((steps for when, steps, _ in self.counts if when <= t), default=0)
        return at(t1) - at(t0)

    def stop(self) -> None:
        """Closing its stdin stops the child: its tenants finish their steps (Fleet.stop), its sessions close."""
        self.proc.stdin.close()
        try:
            self.proc.wait(180)
        except Exception:  # noqa: BLE001 - it had its chance
            self.proc.kill()


def _child(url: str, base_model: str, tenants: int, keys: list[str]) -> None:
    """FleetProcess's child: `tenants` RL tenants until stdin closes; counts on stdout every 0.5 s."""
    import sys
    import threading

    from examples.tiny.build import ensure_tiny_world

    async def run() -> None:
        fleet = Fleet(url, keys, base_model, RlWorkload.from_tiny_world(ensure_tiny_world()))
        loop = asyncio.get_running_loop()
        threading.Thread(target=lambda: (sys.stdin.read(), loop.call_soon_threadsafe(fleet.stopping.set)), daemon=True).start()
        fleet.grow(tenants)
        told = 0
        while not fleet.stopping.is_set():
            for err in fleet.log.errors[told:]:
                print(f"error {err}", flush=True)
            told = len(fleet.log.errors)
            print(f"counts {len(fleet.log.steps)} {sum(1 for t in fleet.tenants if t.steps > 0)}", flush=True)
            await asyncio.sleep(0.5)
        await fleet.stop()

    asyncio.run(run())


if __name__ == "__main__":
    import logging
    import sys

    logging.getLogger("tinker").setLevel(logging.ERROR)  # the SDK warns at every try_again of a long poll
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4:])
