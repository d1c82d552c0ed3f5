"""TensorBoard event files per adapter run (and, optionally, W&B offline runs).

    <state_dir>/tensorboard/<adapter name>/<registration id, first 8 hex>/events.out.tfevents.*
    <state_dir>/tensorboard/_fleet/events.out.tfevents.*          (rounds of the training loop)

`TrainingLog.log_step(...)` is called by the training loop right after a step is
committed to the registry (controller.record_step succeeded), with the values it
committed: every metric of the step's record (the series `GET /v1/adapters/{name}/metrics`
serves: loss, reward_mean, learning_rate, grad_norm, staleness_mean, ...) becomes a
scalar of that tag at the adapter's step, plus `samples` (samples in the step). A
re-registered name gets a folder of its own (its registration id), so TensorBoard
shows each tenant of a name as its own run. `log_round(record)` writes the fleet's
round times (service.loop.fleet_stats.RoundRecord) under `_fleet`, x = round number.

Written with TensorBoard's own writer (`tensorboard.summary.Writer`, scalars in the scalars
plugin's format) over `AppendingEventFile`, an output of this module that appends each flush's
records to the run's one event file in the calling thread: TensorBoard's own DirectoryOutput starts
a writer thread per run and keeps its file open, so 1,024 tenants held 1,024 threads and files in
the coordinator, and every step's flush waited for a thread handoff (issue 26: per-round cost
proportional to resident tenants, not registered ones). View with
`tensorboard --logdir <state_dir>/tensorboard`.

W&B: when the `wandb` package is installed and `WANDB_PROJECT` is set, each adapter
run is also logged to a W&B run of its own, in offline mode (`WANDB_MODE` may say
otherwise), under <state_dir>/wandb; `wandb sync` uploads it later. Nothing is
sent anywhere by default.

Invariants: a step is written at most once per run folder by this process (steps at or
below the last one written are skipped, e.g. a step replayed after a trainer restart);
one lock guards the writers, so the loop and other threads may call in; a failure to
log never stops training (logged and dropped).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FLEET_RUN = "_fleet"


def tensorboard_dir(state_dir: str | Path) -> Path:
    return Path(state_dir) / "tensorboard"


def run_dir(state_dir: str | Path, name: str, registration_id: str) -> Path:
    """The event-file folder of one adapter run."""
    return tensorboard_dir(state_dir) / name / registration_id[:8]


def wandb_configured() -> bool:
    return bool(os.environ.get("WANDB_PROJECT")) and importlib.util.find_spec("wandb") is not None


class TrainingLog:
    def __init__(self, state_dir: str | Path, *, use_wandb: bool | None = None) -> None:
        self.state_dir = Path(state_dir)
        self.root = tensorboard_dir(state_dir)
        self.use_wandb = wandb_configured() if use_wandb is None else use_wandb
        self._lock = threading.Lock()
        self._writers: dict[tuple[str, str], Any] = {}  # (name, registration id) -> tensorboard Writer
        self._last_step: dict[tuple[str, str], int] = {}
        self._wandb_runs: dict[tuple[str, str], Any] = {}
        self._fleet: Any = None
        self._rounds = 0
        self._closed = False

    def log_step(self, name: str, registration_id: str, step: int, metrics: Mapping[str, float], *,
                 samples: int, wall_time: float | None = None) -> bool:
        """Write one committed step; returns False when skipped (already written, or closed)."""
        key = (name, registration_id)
        with self._lock:
            if self._closed or step <= self._last_step.get(key, 0):
                return False
            try:
                writer = self._writers.get(key) or self._open(key)
                for tag, value in sorted({**metrics, "samples": samples}.items()):
                    if isinstance(value, (int, float)) and math.isfinite(value):
                        writer.add_scalar(tag, float(value), step, wall_time=wall_time)
                writer.flush()
                if self.use_wandb:
                    self._wandb_log(key, step, {**metrics, "samples": samples})
            except Exception:  # a full disk must not stop training: say so and go on
                log.warning("could not log step %d of %s to %s", step, name, self.root, exc_info=True)
                return False
            self._last_step[key] = step
            return True

    def log_round(self, record: Any) -> None:
        """One round of the loop (service.loop.fleet_stats.RoundRecord) under `_fleet`."""
        with self._lock:
            if self._closed:
                return
            try:
                if self._fleet is None:
                    self._fleet = self._writer(self.root / FLEET_RUN)
                self._rounds += 1
                values = asdict(record)
                for key in ("collect_s", "train_s", "publish_s", "checkpoint_s", "steps", "samples", "rollout_tokens",
                            "trained_tokens"):
                    self._fleet.add_scalar(f"round/{key}", values[key], self._rounds, wall_time=record.ended_at)
                self._fleet.flush()
            except Exception:
                log.warning("could not log a fleet round to %s", self.root, exc_info=True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for writer in [*self._writers.values(), *([self._fleet] if self._fleet is not None else [])]:
                writer.close()
            for run in self._wandb_runs.values():
                run.finish()
            self._writers.clear()
            self._wandb_runs.clear()

    def __enter__(self) -> TrainingLog:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- inside the lock ------------------------------------------------------------------------

    @staticmethod
    def _writer(folder: Path) -> Any:
        from tensorboard.summary import Output, Writer

        Output.register(AppendingEventFile)  # its interface, without importing TensorBoard with this module
        return Writer(AppendingEventFile(folder))

    def _open(self, key: tuple[str, str]) -> Any:
        writer = self._writers[key] = self._writer(run_dir(self.state_dir, *key))
        return writer

    def _wandb_log(self, key: tuple[str, str], step: int, values: Mapping[str, float]) -> None:
        run = self._wandb_runs.get(key)
        if run is None:
            import wandb

            name, registration_id = key
            folder = self.state_dir / "wandb"
            folder.mkdir(parents=True, exist_ok=True)
            run = self._wandb_runs[key] = wandb.init(
                project=os.environ["WANDB_PROJECT"], name=f"{name}-{registration_id[:8]}", id=registration_id,
                group=name, dir=str(folder), mode=os.environ.get("WANDB_MODE", "offline"), resume="allow",
                reinit="create_new", config={"adapter": name, "registration_id": registration_id},
            )
        run.log({k: v for k, v in values.items() if isinstance(v, (int, float)) and math.isfinite(v)}, step=step)


_UIDS = iter(range(1 << 62))  # event files this process made (a suffix, as TensorBoard's writer has)


class AppendingEventFile:
    """A `tensorboard.summary.Output`: one event file in `folder`, named and framed as TensorBoard's
    EventFileWriter does (``events.out.tfevents.<time>.<host>.<pid>.<uid>``, TFRecord framing with
    masked CRC-32C), written with no thread and no file held open: `emit_scalar` keeps the record,
    `flush` appends the kept records in one write and closes the file again. Holds a few bytes per
    run between flushes, so any number of runs can have one."""

    def __init__(self, folder: Path) -> None:
        from tensorboard.compat.proto import event_pb2

        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_UIDS)}"
        self._records: list[bytes] = []
        self._add(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2",
                                  source_metadata=event_pb2.SourceMetadata(writer="lorafleet.service.tb_log")))
        self.flush()

    def emit_scalar(self, *, plugin_name: str, tag: str, data: Any, step: Any, wall_time: float,
                    tag_metadata: bytes | None = None, description: str | None = None) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.util import tensor_util

        metadata = summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=plugin_name, content=tag_metadata),
            summary_description=description, data_class=summary_pb2.DataClass.DATA_CLASS_SCALAR)
        event = event_pb2.Event(wall_time=wall_time, step=step)
        event.summary.value.add(tag=tag, tensor=tensor_util.make_tensor_proto(data), metadata=metadata)
        self._add(event)

    def _add(self, event: Any) -> None:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._records.append(header + struct.pack("<I", masked_crc32c(header)) + data
                             + struct.pack("<I", masked_crc32c(data)))

    def flush(self) -> None:
        if self._records:
            with open(self.path, "ab") as f:
                f.write(b"".join(self._records))
            self._records.clear()

    def close(self) -> None:
        self.flush()
