"""The LoRA layers' wait on the optimizer step: `AwaitsStep`.

A LoRA layer whose slot rows the optimizer step may still be writing (the step on a CUDA stream
of its own, trainer/optim/step_overlap.py) waits, before it reads them, for its own layer's part
of the step. The trainer sets ``step_overlap`` on every layer when the overlap is on; without it
the wait does nothing. It lives here, with the layers, so that trainer/lora/ does not import the
optimizer (which imports the layers' buffers).
"""

from __future__ import annotations

from typing import Protocol


class StepWaiter(Protocol):
    def wait(self, layer: object) -> None:
        """Make the current stream wait until the last step has written ``layer``'s rows."""


class AwaitsStep:
    """A LoRA layer whose slot rows the optimizer step may still be writing: the trainer sets
    ``step_overlap`` when the overlap is on; its forward calls ``await_step`` before it reads them."""

    step_overlap: StepWaiter | None = None

    def await_step(self) -> None:
        """Wait (on the current stream) until the last optimizer step has written this layer's rows."""
        if self.step_overlap is not None:
            self.step_overlap.wait(self)
