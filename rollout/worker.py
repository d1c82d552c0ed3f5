"""The rollout loop: keeps every active adapter generating, scores groups, fills per-adapter buffers.

`RolloutCore` is plain asyncio (no Ray), so it is tested directly; the Ray
actor (rollout/worker_actor.py) is a thin wrapper that owns one.

The loop (`_pump`) starts groups round-robin over the active adapters, one
group per adapter per pass, within three bounds: requests in flight per
adapter, requests in flight overall, and groups buffered per adapter (a full
buffer stops only that adapter). It never waits on training: training takes
groups with `pop_groups` whenever it wants.

A group is made by the adapter's rollout (rollout/rollouts.py: the built-in
single-turn GRPO, an environment, or an async rollout function) in a
`RolloutContext` (rollout/context.py) bound to the adapter: its requests carry
the adapter's rid prefix and its budgets. The worker then checks the
trajectories, computes group-relative advantages and buffers the group.

Invariants:
* Each group's prompt row is *pending* in its adapter's data source from
  `take` until training pops the group (then `consume`d) or the group is lost
  (aborted, engine died, stale, failed: then `requeue`d). Aborted groups are
  never buffered and never count as progress.
* A group is buffered only if its adapter still has the registration id that
  started it (a removed and re-added adapter never sees the old tenant's work).
* One adapter cannot keep the engines busy with requests they refuse: rows over
  the length limits never leave its data source (skipped, counted), and after
  `max_rejections_in_a_row` refused requests (HTTP 4xx) it stops generating. Either
  way `AdapterStats.fatal_reason` says why, and the service fails the run.
* Tenant code cannot stall the others: a custom rollout runs within its adapter's
  time budget (RolloutSpec.timeout_s; its requests are aborted when it runs out) and its
  plain functions in the adapter's own threads. A group whose custom rollout raises,
  returns something invalid or runs out of time is counted (groups_dropped_error,
  groups_dropped_timeout) and dropped with its row (never trained on, never served
  again this epoch); after RolloutSpec.max_failures_in_a_row such groups in a row the
  adapter stops generating with the reason (`fatal_reason`: the service fails the run).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from rollout.engines.client import EngineError, EngineUnavailable
from rollout.config import RolloutConfig, check_adapter_name
from rollout.context import RolloutAborted, RolloutContext
from rollout.data import DataCursor, DataSource, PromptRow
from rollout.groups import AdapterBuffer, RolloutGroup, trajectory_group
from rollout.messages import PUBLISH_LOADED, PUBLISH_SUPERSEDED, AdapterRollout, AdapterStats, RolloutError
from rollout.engines.pool import EnginePool, NoHealthyEngine, UnknownAdapter
from rollout.rewards import RewardFn, load_reward
from rollout.rollouts import LoadedRollout, load_rollout
from rollout.trajectory import Trajectory
from rollout.engines.weights import AdapterWeights, PendingFolder, VersionSuperseded

log = logging.getLogger(__name__)


@dataclass
class _AdapterRun:
    spec: AdapterRollout
    data: DataSource
    reward: RewardFn | None
    buffer: AdapterBuffer
    rollout: LoadedRollout
    executor: ThreadPoolExecutor | None = None  # a custom rollout's plain functions run here (its own threads)
    paused: bool = False
    aborts: int = 0  # abort_adapter calls so far: a group that started before one stops at its next request
    inflight_requests: int = 0
    inflight_groups: int = 0
    groups_completed: int = 0
    groups_consumed: int = 0
    groups_aborted: int = 0
    groups_requeued: int = 0
    groups_failed: int = 0
    reward_failures: int = 0
    consecutive_failures: int = 0
    rejections_in_a_row: int = 0
    groups_dropped_error: int = 0
    groups_dropped_timeout: int = 0
    trajectories_truncated: int = 0
    failures_in_a_row: int = 0  # groups dropped in a row (custom rollouts)
    retry_at: float = 0.0
    last_error: str | None = None
    fatal_reason: str | None = None
    tasks: set = field(default_factory=set)

    def end_tasks(self) -> list[asyncio.Task]:
        """The group tasks to wait for at removal; a custom rollout's are cancelled first (its requests are
        already aborted; tenant code in a thread must not hold the removal up)."""
        tasks = list(self.tasks)
        if self.rollout.custom:
            for t in tasks:
                t.cancel()
        return tasks

    @property
    def n(self) -> int:
        return self.spec.sampling.n_samples_per_prompt


class RolloutCore:
    """Rollout for many adapters over one EnginePool. All methods run on one asyncio loop."""

    def __init__(self, pool: EnginePool, tokenizer, cfg: RolloutConfig):
        self.pool = pool
        self.tokenizer = tokenizer
        self.cfg = cfg
        self._runs: dict[str, _AdapterRun] = {}
        self._rr: list[str] = []  # round-robin order
        self._rr_next = 0
        self._inflight_total = 0
        self._wake = asyncio.Event()
        self._pump_task: asyncio.Task | None = None
        self._stopping = False

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._pump_task is None:
            self._stopping = False
            self._pump_task = asyncio.get_running_loop().create_task(self._pump())

    async def stop(self) -> None:
        """Stop starting groups, abort everything in flight, wait for the group tasks to end."""
        self._stopping = True
        self._wake.set()
        if self._pump_task is not None:
            self._pump_task.cancel()
            try:
                await self._pump_task
            except asyncio.CancelledError:
                pass
            self._pump_task = None
        for name in list(self._runs):
            await self.pool.abort_adapter(name)
        tasks = [t for r in self._runs.values() for t in r.end_tasks()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for r in self._runs.values():
            if r.executor is not None:
                r.executor.shutdown(wait=False, cancel_futures=True)

    # --- adapters ----------------------------------------------------------------------------

    def _run(self, name: str) -> _AdapterRun:
        try:
            return self._runs[name]
        except KeyError:
            raise UnknownAdapter(name) from None

    async def add_adapter(self, spec: AdapterRollout, weights: AdapterWeights) -> AdapterStats:
        """Open the adapter's data and reward, publish its first weights, start generating for it.

        Bad data, reward or sampling settings are refused before anything changes."""
        check_adapter_name(spec.name)
        if spec.name in self._runs:
            raise RolloutError(f"adapter {spec.name} is already active in the rollout worker; remove it first")
        n = spec.sampling.n_samples_per_prompt
        if n > self.cfg.max_inflight_per_adapter:
            raise RolloutError(
                f"adapter {spec.name}: n_samples_per_prompt ({n}) exceeds max_inflight_per_adapter "
                f"({self.cfg.max_inflight_per_adapter}); a group could never start"
            )
        rollout = load_rollout(spec.rollout, self.cfg.rollout_import_roots)
        if spec.reward is None and not rollout.custom:
            raise RolloutError(f"adapter {spec.name}: the built-in rollout {rollout.name!r} needs a reward")
        reward = None if spec.reward is None else load_reward(spec.reward, self.cfg.reward_import_roots)
        data = await asyncio.to_thread(DataSource, spec.data, self.tokenizer, spec.cursor)
        await self.pool.publish(spec.name, spec.initial_version, weights)
        staleness = self.cfg.max_staleness if spec.max_staleness is None else spec.max_staleness
        buffer = AdapterBuffer(spec.name, spec.registration_id, staleness)
        buffer.note_published(spec.initial_version)
        executor = ThreadPoolExecutor(max_workers=max(4, n), thread_name_prefix=f"rollout-{spec.name}") if rollout.custom else None
        self._runs[spec.name] = _AdapterRun(spec, data, reward, buffer, rollout, executor)
        self._rr.append(spec.name)
        self._wake.set()
        return self.stats(spec.name)

    async def remove_adapter(self, name: str) -> int:
        """Stop generating for the adapter, abort its requests, unload its versions, drop its buffer.

        Returns how many requests were aborted. Unknown names are a no-op (0)."""
        run = self._runs.pop(name, None)
        if run is None:
            await self.pool.remove_adapter(name)  # engines may still hold it after a worker restart
            return 0
        self._rr.remove(name)
        aborted = await self.pool.remove_adapter(name)
        tasks = run.end_tasks()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if run.executor is not None:
            run.executor.shutdown(wait=False, cancel_futures=True)
        run.buffer.drain()
        return aborted

    async def publish_version(self, name: str, version: int, weights: AdapterWeights | PendingFolder) -> str:
        """New weights for the adapter (or a handoff folder still being written: awaited first): new
        groups use them once every engine in routing loaded them; stale buffered groups drop on pop.
        Returns PUBLISH_LOADED, or PUBLISH_SUPERSEDED for a version that is never served.

        The buffer counts the version as published *before* the load (the trainer already holds these
        weights): a training step that pops groups while the engines still load it sees the groups of
        older weights one publish further behind, so no step takes groups staler than the adapter's
        bound allows (issue 18 item 4). A failed load leaves that count one too high: conservative.

        Latest-wins (issue 28): a version is superseded, never loaded and never routed to, when the
        trainer never wrote its folder (a newer publish of the adapter replaced it in the writer's
        queue: PendingFolder.ready raises VersionSuperseded) or when a newer version is current by
        the time its folder is ready (its folder is deleted). It still counts for staleness: it was
        a step of the adapter, so groups of older weights are that much further behind the trainer."""
        run = self._run(name)
        run.buffer.note_published(version)
        try:
            if isinstance(weights, PendingFolder):  # the trainer is still writing it (the loop did not wait)
                try:
                    weights = await weights.ready()
                except VersionSuperseded as e:
                    log.info("adapter %s v%d is never served: %s", name, version, e)
                    return PUBLISH_SUPERSEDED
            if version <= self.pool.current_version(name):  # a newer version was loaded first
                log.info("adapter %s v%d is never served: v%d is current", name, version, self.pool.current_version(name))
                weights.discard()
                return PUBLISH_SUPERSEDED
            await self.pool.publish(name, version, weights)
            return PUBLISH_LOADED
        finally:
            self._wake.set()

    async def abort_adapter(self, name: str, *, pause: bool = False) -> int:
        """Abort the adapter's in-flight requests (their prompts are re-queued); return how many.

        With pause=True no new group starts until `resume_adapter`."""
        run = self._run(name)
        if pause:
            run.paused = True
        run.aborts += 1  # groups under way stop at their next request (a multi-turn agent between turns)
        count = await self.pool.abort_adapter(name)
        self._wake.set()
        return count

    def resume_adapter(self, name: str) -> None:
        self._run(name).paused = False
        self._wake.set()

    def pop_groups(self, name: str, max_groups: int) -> list[RolloutGroup]:
        """Up to `max_groups` ready groups of the adapter for training (oldest first).

        Groups too stale for the adapter's current version are dropped here and
        their prompts re-queued; returned groups count as consumed data."""
        run = self._run(name)
        ready, stale = run.buffer.pop(max_groups, self.pool.current_version(name))
        for g in stale:
            self._requeue(run, g.row)
        for g in ready:
            if g.row is not None:
                run.data.consume(g.row)
        run.groups_consumed += len(ready)
        if stale or ready:
            self._wake.set()
        return ready

    def data_cursor(self, name: str) -> DataCursor:
        """Resume point of the adapter's data (rows not yet popped for training come back first)."""
        return self._run(name).data.cursor()

    def adapters(self) -> list[str]:
        return list(self._rr)

    def stats(self, name: str) -> AdapterStats:
        run = self._run(name)
        return AdapterStats(
            name=name,
            registration_id=run.spec.registration_id,
            version=self.pool.current_version(name),
            paused=run.paused,
            inflight_requests=run.inflight_requests,
            inflight_groups=run.inflight_groups,
            buffered_groups=len(run.buffer),
            groups_completed=run.groups_completed,
            groups_consumed=run.groups_consumed,
            groups_aborted=run.groups_aborted,
            groups_requeued=run.groups_requeued,
            groups_failed=run.groups_failed,
            dropped_stale=run.buffer.dropped_stale,
            refused_foreign=run.buffer.refused_foreign,
            reward_failures=run.reward_failures,
            rejections_in_a_row=run.rejections_in_a_row,
            last_error=run.last_error,
            fatal_reason=run.fatal_reason,
            data=run.data.status(),
            groups_dropped_error=run.groups_dropped_error,
            groups_dropped_timeout=run.groups_dropped_timeout,
            trajectories_truncated=run.trajectories_truncated,
        )

    # --- the loop ----------------------------------------------------------------------------

    def _can_start(self, run: _AdapterRun, now: float) -> bool:
        return (
            not run.paused
            and run.fatal_reason is None
            and now >= run.retry_at
            and run.inflight_requests + run.n <= self.cfg.max_inflight_per_adapter
            and self._inflight_total + run.n <= self.cfg.max_inflight_total
            and len(run.buffer) + run.inflight_groups < self.cfg.max_buffered_groups_per_adapter
        )

    def _start_round(self) -> int:
        """One round-robin pass: at most one new group per adapter. Returns groups started."""
        started = 0
        now = time.monotonic()
        order = self._rr[self._rr_next:] + self._rr[: self._rr_next]
        for name in order:
            run = self._runs[name]
            if not self._can_start(run, now):
                continue
            row = run.data.take()
            if row is None:
                if run.fatal_reason is None and run.data.unusable is not None:
                    self._fatal(run, run.data.unusable)
                continue
            self._launch(run, row)
            started += 1
        if self._rr:
            self._rr_next = (self._rr_next + 1) % len(self._rr)
        return started

    def _launch(self, run: _AdapterRun, row: PromptRow) -> None:
        run.inflight_requests += run.n
        run.inflight_groups += 1
        self._inflight_total += run.n
        task = asyncio.get_running_loop().create_task(self._run_group(run, row))
        run.tasks.add(task)
        task.add_done_callback(run.tasks.discard)

    async def _pump(self) -> None:
        while not self._stopping:
            try:
                no_engine = not any(self.pool.healthy(i) for i in range(self.pool.num_engines))
                started = 0 if no_engine else self._start_round()
            except Exception:  # never let one bad adapter stop every adapter's rollout
                log.exception("rollout pump")
                started = 0
            if started == 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.25)
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)

    def _requeue(self, run: _AdapterRun, row: PromptRow | None) -> None:
        if row is not None:
            run.data.requeue(row)
            run.groups_requeued += 1

    def _fatal(self, run: _AdapterRun, reason: str) -> None:
        """The adapter can never make progress: it stops generating; the reason is in its stats."""
        run.fatal_reason = reason[:2000]
        log.warning("adapter %s stops generating: %s", run.spec.name, run.fatal_reason)

    def _fail(self, run: _AdapterRun, row: PromptRow, err: BaseException) -> None:
        run.groups_failed += 1
        run.last_error = f"{type(err).__name__}: {err}"[:2000]
        run.consecutive_failures += 1
        if isinstance(err, EngineError) and not isinstance(err, EngineUnavailable) and err.status is not None and 400 <= err.status < 500:
            run.rejections_in_a_row += 1  # the engine refused the request itself (e.g. longer than its context)
            if run.rejections_in_a_row >= self.cfg.max_rejections_in_a_row and run.fatal_reason is None:
                self._fatal(run, f"the engines refused {run.rejections_in_a_row} requests in a row (HTTP {err.status}); "
                                 f"last: {err.body[:500] or err}")
        # Back off so a persistent error (e.g. the engine refuses the adapter) does not spin.
        run.retry_at = time.monotonic() + min(0.1 * 2 ** (run.consecutive_failures - 1), 5.0)
        self._requeue(run, row)

    def _drop(self, run: _AdapterRun, row: PromptRow, reason: str, *, timed_out: bool) -> None:
        """A custom rollout failed this group: counted and dropped with its row (see the module doc)."""
        if timed_out:
            run.groups_dropped_timeout += 1
        else:
            run.groups_dropped_error += 1
        run.failures_in_a_row += 1
        run.last_error = reason[:2000]
        run.data.drop(row)
        log.warning("adapter %s: group dropped: %s", run.spec.name, run.last_error)
        limit = run.spec.rollout.max_failures_in_a_row if run.spec.rollout is not None else 1
        if run.failures_in_a_row >= limit and run.fatal_reason is None:
            self._fatal(run, f"its rollout failed on {run.failures_in_a_row} groups in a row; last: {run.last_error}")

    def _context(self, run: _AdapterRun) -> RolloutContext:
        spec, aborts = run.spec.rollout, run.aborts
        return RolloutContext(
            self.pool, run.spec.name, n=run.n, sampling=run.spec.sampling, tokenizer=self.tokenizer,
            max_tokens=spec.max_tokens if spec is not None else None, max_turns=spec.max_turns if spec is not None else 1,
            reward=run.reward, reward_timeout_s=self.cfg.reward_timeout_s, aborted=lambda: run.aborts != aborts,
            executor=run.executor,
        )

    async def _rollout(self, run: _AdapterRun, ctx: RolloutContext, row: PromptRow) -> list[Trajectory]:
        """The group's trajectories, checked; TimeoutError (only) when the adapter's time budget ran out."""
        budget = run.spec.rollout.timeout_s if run.spec.rollout is not None else None
        scope = asyncio.timeout(budget)
        try:
            async with scope:
                out = await run.rollout.run(ctx, row)
        except TimeoutError:
            if scope.expired():
                raise
            raise _TenantTimeout("the rollout raised TimeoutError") from None  # the tenant's own, not the budget
        if ctx.was_aborted:  # a rollout that caught RolloutAborted is still aborted
            raise RolloutAborted(f"adapter {run.spec.name}: aborted")
        return ctx.check(out)

    async def _run_group(self, run: _AdapterRun, row: PromptRow) -> None:
        name = run.spec.name
        try:
            ctx = self._context(run)
            try:
                trajectories = await self._rollout(run, ctx, row)
            except UnknownAdapter:
                return  # removed meanwhile: its data source goes away with it
            except Exception as e:
                if self._runs.get(name) is not run:
                    return  # removed (and maybe re-added by a new tenant) while generating
                if isinstance(e, RolloutAborted):
                    run.groups_aborted += 1
                    self._requeue(run, row)
                elif isinstance(e, EngineError | NoHealthyEngine):
                    self._fail(run, row, e)  # the engines' fault, not the rollout's: re-queued, backed off
                elif isinstance(e, TimeoutError):
                    self._drop(run, row, f"rollout {run.rollout.name} ran past its time budget of "
                                         f"{run.spec.rollout.timeout_s:g} s (rollout.timeout_s)", timed_out=True)
                elif run.rollout.custom:
                    self._drop(run, row, f"rollout {run.rollout.name} failed: {type(e).__name__}: {e}", timed_out=False)
                else:  # anything unexpected in a built-in rollout: never lose the row
                    log.warning("adapter %s: generation failed: %s", name, e)
                    self._fail(run, row, e)
                return
            if self._runs.get(name) is not run:
                return  # removed (and maybe re-added by a new tenant) while generating
            run.reward_failures += sum(t.reward_error is not None for t in trajectories)
            prompt_ids = list(trajectories[0].prompt_ids)
            group = trajectory_group(
                trajectories, adapter=name, registration_id=run.spec.registration_id, row=row,
                prompt_text=row.prompt_text if prompt_ids == list(row.input_ids) else self.tokenizer.decode(prompt_ids),
                engine=ctx.generated[trajectories[0].segments[0].rid].engine,
            )
            if not run.buffer.put(group):
                return
            run.groups_completed += 1
            run.trajectories_truncated += sum(t.truncated for t in trajectories)
            run.consecutive_failures = 0
            run.rejections_in_a_row = 0
            run.failures_in_a_row = 0
        finally:
            run.inflight_requests -= run.n
            run.inflight_groups -= 1
            self._inflight_total -= run.n
            self._wake.set()


class _TenantTimeout(Exception):
    """A TimeoutError the rollout raised itself (its own time limit), not the adapter's budget."""
