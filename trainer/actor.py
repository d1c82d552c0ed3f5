"""One trainer rank as a Ray actor's body: `TrainWorker`.

`TrainWorker` holds one `MultiLoraTrainer` (one rank of tp * dp) and implements the trainer's
interface (trainer/interface.py `TrainerInterface`) over it, one method each, typed. The service runs one actor per rank
(service/fleet/trainer_group.py starts them with the options of service/fleet/actors.py and
calls every rank with the same arguments; rank 0 answers, as all ranks compute the
same metrics). Data parallelism: every rank receives the whole batch and trains its
own share (trainer/batch.py `dp_shard`); only the gradients of the slots that step
cross the DP group (an all-reduce inside `MultiLoraTrainer`), never the frozen base.

Exports for publishing (issue 18) come in two calls: `export_peft_in_background` in the
default group, in order with train calls (it snapshots the weights, then rank 0's writer
thread writes the folder), and `wait_export` in the EXPORT_GROUP group, which returns when
the folder is written; the next train call does not wait for the write.

This module imports neither ray nor the trainer's core at module level: the class
is plain, so the GPU tier imports it without Ray, and the model is built in `setup`. The round
runs here (trainer/step/round_runner.py `RoundRunner` over the rank's trainer): the actor is the
one hop between the trainer group's fan-out and the step.
"""

from __future__ import annotations

import gc
import os
import socket
import threading
from pathlib import Path
from typing import Any

from trainer.config import SlotHyperParams, TrainerConfig
from trainer.interface import Health, WrittenFolder
from trainer.rounds import RoundResult, RoundWork
from trainer.step.round_runner import RoundRunner

# The Ray concurrency group (besides the default one, max_concurrency 1, where every collective
# call runs in submission order) in which `wait_export` waits for a background write: one thread,
# so a waiting export never holds up a train call. service/fleet/actors.py defines it on the actor.
EXPORT_GROUP = "export"
# One more thread for fault-injection calls (tests run a function of theirs on the rank with
# `worker.__ray_call__.options(concurrency_group=FAULT_GROUP)`: tests/trainer_probes.py), so they
# reach the rank while the default group is busy or blocked and while wait_export calls wait in
# EXPORT_GROUP. No test-only method lives on TrainWorker.
FAULT_GROUP = "fault"


class TrainWorker:
    """One trainer rank. As a Ray actor it is constructed empty and `setup` builds the model once
    all ranks are placed; in process it is made over a built trainer (the tests' in-process Tinker
    host), so one typed interface serves both."""

    def __init__(self, trainer: Any = None) -> None:
        self.trainer: Any = trainer  # trainer.core.MultiLoraTrainer (after setup, as an actor)
        self._slot_state_writer: Any = None  # made on first use (_state_writer)
        self._state_writer_lock = threading.Lock()  # the default group and EXPORT_GROUP may both ask first

    def pid(self) -> int:
        """This rank's process id (GET /v1/fleet lists it; also the cheapest liveness probe)."""
        return os.getpid()

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process-group rendezvous."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def setup(self, config: dict, rank: int, master_addr: str, master_port: int) -> dict:
        from trainer.core import MultiLoraTrainer

        self.trainer = MultiLoraTrainer(TrainerConfig(**config), rank=rank, master_addr=master_addr, master_port=master_port)
        gc.collect()  # the rank's imports and model (about a million objects) live as long as it does:
        gc.freeze()  # left out of every later collection (service/modes.py freeze_startup_objects says why)
        layout = self.trainer.layout
        return {"rank": layout.rank, "tp_rank": layout.tp_rank, "dp_rank": layout.dp_rank, "device": str(self.trainer.device)}

    def _core(self) -> Any:
        if self.trainer is None:
            raise RuntimeError("TrainWorker.setup has not run")
        return self.trainer

    # The trainer's interface (trainer/core.py and its rooms: export, checkpoint, swap), one
    # method each; all collective.
    def init_slot(self, slot: int, hyper: SlotHyperParams, seed: int, init_from: str | None = None,
                  registration: str | None = None) -> dict:
        return self._core().init_slot(slot, hyper, seed, init_from=init_from, registration=registration)

    def clear_slot(self, slot: int) -> None:
        self._core().clear_slot(slot)

    def peft_tensors(self, slot: int):
        return self._core().export.peft_tensors(slot)

    def export_peft(self, slot: int, out_dir: str | Path, dtype: str = "float32", durable: bool = True) -> str:
        return self._core().export.export_peft(slot, str(out_dir), dtype=dtype, durable=durable)

    def export_peft_in_background(self, slot: int, out_dir: str | Path, dtype: str = "float32", key: str | None = None) -> str:
        """The export's snapshot now, in call order (default concurrency group, like train), cast
        to `dtype`; the write on rank 0's writer thread. Returns before the folder is written: see
        wait_export. `key`: latest-wins (a queued export of the same key is superseded)."""
        return self._core().export.export_peft_in_background(slot, str(out_dir), dtype=dtype, key=key)

    def wait_export(self, out_dir: str | Path):  # noqa: ANN201 - str, or trainer.export.export_writer.Superseded
        """Returns once the background export to `out_dir` is written (the folder) or superseded (a
        trainer.export.export_writer.Superseded: never written); raises if it failed.
        Dispatched in the EXPORT_GROUP concurrency group, so it waits beside train calls
        instead of ahead of them (service/fleet/trainer_group.py begin_export_peft)."""
        return self._core().export.wait_export(str(out_dir))

    def save_slot_state(self, slot: int, out_dir: str | Path) -> str:
        from trainer.swap.slot_checkpoint import save_slot_state

        return save_slot_state(self._core(), slot, str(out_dir))

    def begin_save_slot_state(self, slot: int, out_dir: str | Path) -> WrittenFolder:
        """In process (the tests' in-process host): `save_slot_state`, written before it returns. As an
        actor the trainer group calls the two halves below instead (service/fleet/trainer_group.py)."""
        return WrittenFolder(self.save_slot_state(slot, out_dir))

    def save_slot_state_in_background(self, slot: int, out_dir: str | Path) -> str:
        """The slot's state taken now (default group: in order with train calls, collective), its write
        on rank 0's slot-state writer thread; `wait_slot_state` (EXPORT_GROUP) returns once it is
        committed. The next train call does not wait for the write (issue 41: a Tinker model's
        periodic snapshot no longer holds up every slot's round)."""
        from trainer.swap.slot_checkpoint import save_slot_state_in_background

        return save_slot_state_in_background(self._core(), slot, str(out_dir), self._state_writer())

    def wait_slot_state(self, out_dir: str | Path) -> str:
        """Returns once the background save to `out_dir` is committed; raises if it failed. Ranks
        other than 0 write nothing and return at once."""
        if self._core().layout.rank != 0:
            return str(out_dir)
        return self._state_writer().wait(str(out_dir))

    def _state_writer(self) -> Any:  # trainer.export.export_writer.ExportWriter
        """Rank 0's slot-state writer: one thread, each job a closure that writes one folder."""
        from trainer.export.export_writer import ExportWriter

        with self._state_writer_lock:
            if self._slot_state_writer is None:
                self._slot_state_writer = ExportWriter(lambda folder, write: write(), threads=1, name="slot-state-writer")
            return self._slot_state_writer

    def load_slot_state(self, slot: int, in_dir: str | Path, registration: str | None = None) -> dict:
        from trainer.swap.slot_checkpoint import load_slot_state

        return load_slot_state(self._core(), slot, str(in_dir), registration=registration)

    def reset_optimizer(self, slot: int) -> None:
        self._core().reset_optimizer(slot)

    def run_round(self, work: RoundWork) -> RoundResult:
        """The scheduler's round (trainer/rounds.py): dataset samples and Tinker calls in ONE mixed step."""
        return RoundRunner(self._core(), max_seq_len=work.max_seq_len).run_round(work)

    # Keep-warm eviction (trainer/swap/slot_swap.py): a slot's whole state to this rank's host
    # memory (spilling to swap_spill_dir beyond swap_host_budget_mb, up to swap_disk_budget_mb)
    # under a key, and back.
    def swap_out(self, slot: int, key: str) -> dict:
        return self._core().swap.swap_out(slot, key)

    def swap_in(self, slot: int, key: str) -> dict:
        return self._core().swap.swap_in(slot, key)

    def prefetch_swapped(self, key: str) -> str:
        """Start reading a spilled snapshot into host memory (returns at once; see SwapStore.prefetch)."""
        return self._core().swap.prefetch(key)

    def drop_swapped(self, key: str) -> bool:
        return self._core().swap.drop(key)

    def swap_tiers(self) -> dict:
        return self._core().swap.tiers()

    def health(self) -> Health:
        """It answers: this rank is alive (a rank busy in a call answers after it)."""
        core = self.trainer
        where = f"rank {core.layout.rank} on {core.device}" if core is not None else "not set up"
        return Health(core is not None, where)
