"""Ray wrapper of the trainer: one actor per device, and the group that drives them.

``TrainWorker`` holds one ``MultiLoraTrainer`` (one rank of tp * dp). Every
trainer method is collective, so ``TrainActorGroup`` calls each method on all
workers at once with the same arguments and returns rank 0's answer (all ranks
compute the same metrics). Data parallelism: every worker receives the whole
batch and trains its own share (trainer/batch.py ``dp_shard``); only the
gradients of the slots that step cross the DP group (an all-reduce inside
``MultiLoraTrainer``), never the frozen base.

This module imports ray; the trainer core (trainer/core.py) does not.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import ray

from trainer.batch import TrainBatch
from trainer.config import SlotHyperParams, TrainerConfig


class TrainWorker:
    """One trainer rank. Constructed empty; ``setup`` builds the model once all ranks are placed."""

    def __init__(self) -> None:
        self.trainer = None

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process-group rendezvous."""
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def setup(self, config: dict, rank: int, master_addr: str, master_port: int) -> dict:
        from trainer.core import MultiLoraTrainer

        self.trainer = MultiLoraTrainer(TrainerConfig(**config), rank=rank, master_addr=master_addr, master_port=master_port)
        layout = self.trainer.layout
        return {"rank": layout.rank, "tp_rank": layout.tp_rank, "dp_rank": layout.dp_rank, "device": str(self.trainer.device)}

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.trainer is None:
            raise RuntimeError("TrainWorker.setup has not run")
        return getattr(self.trainer, method)(*args, **kwargs)

    def slot_state_tensors(self, slot: int):
        return self.trainer.slot_state_tensors(slot)


class TrainActorGroup:
    """tp * dp TrainWorker actors acting as one trainer.

    ``actor_options``: extra ``ray.remote(...).options`` per rank (e.g. a placement
    group bundle from the service's placement plan); by default each worker asks for
    one GPU where the cluster has GPUs, else one CPU.
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        actor_options: list[dict] | None = None,
        use_gpus: bool | None = None,
        setup_timeout_s: float = 900.0,
        call_timeout_s: float = 3600.0,
    ) -> None:
        world = config.tp * config.dp
        if actor_options is not None and len(actor_options) != world:
            raise ValueError(f"actor_options has {len(actor_options)} entries, need tp*dp = {world}")
        if use_gpus is None:
            use_gpus = ray.cluster_resources().get("GPU", 0) >= world
        default = {"num_gpus": 1, "num_cpus": 1} if use_gpus else {"num_cpus": 1}
        env = {} if use_gpus else {"env_vars": {"TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE", "1")}}
        remote_cls = ray.remote(TrainWorker)
        self.config = config
        self.call_timeout_s = call_timeout_s
        self.workers = [
            remote_cls.options(**(default | ({"runtime_env": env} if env else {}) | (actor_options[r] if actor_options else {}))).remote()
            for r in range(world)
        ]
        try:
            addr, port = ray.get(self.workers[0].master_address.remote(), timeout=setup_timeout_s)
            self.placement = ray.get(
                [w.setup.remote(config.model_dump(), r, addr, port) for r, w in enumerate(self.workers)],
                timeout=setup_timeout_s,
            )
        except Exception:
            self.shutdown()
            raise

    def _all(self, method: str, *args: Any, **kwargs: Any) -> list:
        return ray.get([w.call.remote(method, *args, **kwargs) for w in self.workers], timeout=self.call_timeout_s)

    # The trainer's interface (trainer/core.py), answered by rank 0.
    def init_slot(self, slot: int, hyper: SlotHyperParams, seed: int, init_from: str | Path | None = None, registration: str | None = None) -> dict:
        return self._all("init_slot", slot, hyper, seed, init_from=init_from, registration=registration)[0]

    def clear_slot(self, slot: int) -> None:
        self._all("clear_slot", slot)

    def slot_status(self, slot: int) -> dict:
        return self._all("slot_status", slot)[0]

    def train(self, batch: TrainBatch):
        return self._all("train", batch)[0]

    def export_peft(self, slot: int, out_dir: str | Path) -> str:
        return self._all("export_peft", slot, str(out_dir))[0]

    def peft_tensors(self, slot: int):
        return self._all("peft_tensors", slot)[0]

    def save_slot_state(self, slot: int, out_dir: str | Path) -> str:
        return self._all("save_slot_state", slot, str(out_dir))[0]

    def load_slot_state(self, slot: int, in_dir: str | Path, registration: str | None = None) -> dict:
        return self._all("load_slot_state", slot, str(in_dir), registration=registration)[0]

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
