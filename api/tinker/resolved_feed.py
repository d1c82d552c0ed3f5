"""The coordinator's side of parked polls (issue 41): which watched futures finished, told to the API front.

A Tinker call queued for a trainer slot can wait many minutes with a thousand tenants; its client
polls `retrieve_future` all that time, each poll held `POLL_HOLD_S` and sent again. Without help
every poll crosses the coordinator's app, whose interpreter the training loop shares (a thousand
waiting tenants: about 34 polls a second, 7 a tenant-step). With the front on, the front holds
the repeat polls itself (api/front/parked_polls.py) and asks the coordinator again only when the
future finished or its last answer is old. This module tells it when a future finished.

Protocol, over a pipe the coordinator makes when it starts the front (api/server.py):
  * the coordinator answers a poll of a still-running future it watches with the header
    ``PARKABLE_HEADER`` (FutureStore.watch marks the entry watched): a promise that its id is written
    here when it finishes, whatever finishes it (result, error, cancel: FutureStore.resolve, the one
    place a future finishes);
  * each finished watched future: its request id and a newline;
  * ``RESET`` and a newline: ids may have been lost (the pipe was full, so the front was not reading);
    the front then asks the coordinator again for everything it holds;
  * the pipe's end (the coordinator gone): the front parks nothing more (and exits with its parent).
Writes never block the coordinator (the pipe is non-blocking): a full pipe loses the id, and the
next write that fits sends ``RESET`` first.
"""

from __future__ import annotations

import logging
import os

from api.front.parked_polls import PARKABLE_HEADER as _PARKABLE, RESET

log = logging.getLogger(__name__)

PARKABLE_HEADER = _PARKABLE.decode()  # the protocol's names live with the front, which imports nothing of ours


class ResolvedFeed:
    """The write end of the pipe to the front (non-blocking; this object owns the descriptor)."""

    def __init__(self, fd: int) -> None:
        os.set_blocking(fd, False)
        self.fd: int | None = fd
        self.lost = False  # an id did not fit: RESET goes first at the next write
        self.announced = 0

    def announce(self, request_id: str) -> None:
        if self.fd is None:
            return
        line = request_id.encode() + b"\n"
        try:
            if self.lost:
                os.write(self.fd, RESET + b"\n")
                self.lost = False
            os.write(self.fd, line)  # at most PIPE_BUF bytes: written whole or not at all
            self.announced += 1
        except BlockingIOError:
            self.lost = True
        except OSError as err:  # the front is gone (it exits with the coordinator; a restart makes a new pipe)
            log.info("the front's feed of finished futures closed (%s): its parked polls are asked again", err)
            self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
