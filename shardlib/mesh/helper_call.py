"""A blocking call run on a helper thread and waited on like a gloo work.

:meth:`~shardlib.mesh.watchdog.Watchdog.call` runs ``torch.distributed`` calls that shardlib
does not issue itself (DCP's collectives in a checkpoint, ``all_gather_object``) this way, so the
main thread waits for them in the watchdog's slices and a frozen or lost peer is named.
"""

from __future__ import annotations

import datetime
import threading

__all__ = ["HelperCall"]


class HelperCall:
    """``fn()`` run on a helper thread, waited on by :meth:`Watchdog.wait` as if it were a gloo
    work: a wait of a slice that does not see it end raises a "timed out" error (a slice)."""

    def __init__(self, fn, collective: bool):
        self.result, self.error, self._collective = None, None, collective
        self._done = threading.Event()
        self._seen = False  # the last wait saw the end (not: it ended just after that wait's slice)
        threading.Thread(target=self._run, args=(fn,), name="shardlib-call", daemon=True).start()

    def _run(self, fn) -> None:
        try:
            self.result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._seen

    def wait(self, timeout: datetime.timedelta) -> None:
        self._seen = self._done.wait(timeout.total_seconds())
        if not self._seen:
            raise TimeoutError("timed out (a slice of the watchdog's wait; the call runs on)")
        if self._collective and isinstance(self.error, Exception):
            raise self.error  # the collective failed: a peer is gone (diagnosed by the wait)
