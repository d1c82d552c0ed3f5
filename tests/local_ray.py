"""Ray started inside the pytest process (tests that drive actors directly), without a crash
at shutdown.

CI saw pytest die (exit 1, no summary) in the teardown of tests/unit/test_placement_ray.py; the
driver's Ray log said, from a thread that was not the test's: "The core worker has already been
shutdown. This happens when the language frontend accesses the Ray's worker after it is
shutdown. The process will exit". Ray handles (ObjectRefs, actor handles) of an EARLIER session
that sit in reference cycles are freed whenever the cyclic garbage collector runs, in whatever
thread allocates at that moment (the tinker SDK's heartbeat threads are such threads); freed
while a core worker is being shut down, they end the process. So: collect before every start
(no core worker exists: freeing is a no-op) and before every stop (the worker is alive), and
keep the collector off while Ray shuts down.
"""

from __future__ import annotations

import gc


def start_ray(**init_kwargs) -> None:
    import ray

    gc.collect()  # an earlier session's leftover handles: freed while no core worker exists
    ray.init(**init_kwargs)


def stop_ray() -> None:
    import ray

    gc.collect()  # this session's garbage handles: freed while the core worker is alive
    gc.disable()  # no cyclic collection in any thread while the core worker shuts down
    try:
        ray.shutdown()
    finally:
        gc.enable()
