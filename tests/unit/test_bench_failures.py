"""benchmarks/failures.py: a failed benchmark case says why, also from a spawned process.

Real ``torch.multiprocessing.spawn`` children: one raises an out-of-memory error (raised by
hand: a CUDA OOM cannot be caused on this CPU machine; torch's own error type and message
form), one is killed by a signal. In-process errors keep their type and first line."""

import os
import signal

import pytest
import torch

from benchmarks.failures import describe_failure, is_oom

pytestmark = pytest.mark.unit

OOM_TEXT = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB"


def _child(rank: int, how: str) -> None:
    if how == "oom":
        raise torch.OutOfMemoryError(OOM_TEXT)
    os.kill(os.getpid(), signal.SIGKILL)


def _spawn_failure(how: str) -> BaseException:
    import torch.multiprocessing as mp

    with pytest.raises(Exception) as info:
        mp.spawn(_child, args=(how,), nprocs=1, join=True)
    return info.value


def test_a_child_oom_says_oom_and_the_child_error():
    err = _spawn_failure("oom")
    assert str(err).splitlines()[0] == ""  # what the old "process failed: {first line}" printed
    text = describe_failure(err)
    assert text.startswith("OOM: process 0 raised torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert "\n" not in text


def test_a_killed_child_and_in_process_errors_say_what_happened():
    killed = _spawn_failure("kill")
    assert describe_failure(killed) == "ProcessExitedException: process 0 terminated with signal SIGKILL"
    assert not is_oom(killed)
    assert describe_failure(ValueError("layout 'tp3'\nis not one")) == "ValueError: layout 'tp3'"
    assert describe_failure(torch.OutOfMemoryError(OOM_TEXT + "\nsecond line")) == f"OOM: OutOfMemoryError: {OOM_TEXT}"
    assert describe_failure(RuntimeError()) == "RuntimeError: RuntimeError()"
    assert describe_failure(KeyError("x" * 1000)).endswith("x") and len(describe_failure(KeyError("x" * 1000))) == 400
