"""Why a benchmark case failed, in one line: what every benchmark prints and records for it.

``str(err).splitlines()[0]`` is not enough: a child process's exception comes back from
``torch.multiprocessing.spawn`` as ``ProcessRaisedException`` whose message starts with
two newlines ("\\n\\n-- Process 0 terminated with the following error:\\n<traceback>"), so its
first line is empty (the 8B ``--recompute none`` run printed "process failed: " and no
reason). ``describe_failure`` takes the child's own exception (the traceback's last line),
names the type, and says OOM where the device ran out of memory.
"""

from __future__ import annotations

MAX_CHARS = 400


def is_oom(err: BaseException) -> bool:
    """An out-of-memory failure: torch's OutOfMemoryError, here or in a spawned child (its
    traceback comes back as text), or a host MemoryError."""
    import torch

    if isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)):
        return True
    text = str(err)
    return "out of memory" in text.lower() or "OutOfMemoryError" in text


def describe_failure(err: BaseException, max_chars: int = MAX_CHARS) -> str:
    """``[OOM: ]<Type>: <message>`` on one line, never without a reason."""
    from torch.multiprocessing import ProcessRaisedException

    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if isinstance(err, ProcessRaisedException) and lines:
        # the child's traceback: its last line is "<module.Type>: <message>" of what the child raised
        what = f"process {err.error_index} raised {lines[-1]}"
    else:
        what = f"{type(err).__name__}: {lines[0] if lines else repr(err)}"
    return (("OOM: " if is_oom(err) else "") + what)[:max_chars]


def attempt(fn) -> dict:  # noqa: ANN001 - a benchmark case: () -> dict
    """``fn()``, or ``{"error": describe_failure(err)}`` when it raises: the case is reported and
    the run goes on (after an OOM the allocator's cache is emptied; any other error's traceback
    is printed)."""
    import traceback

    import torch

    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - reported in the case's row
        if is_oom(err):
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        else:
            traceback.print_exc()
        return {"error": describe_failure(err)}
