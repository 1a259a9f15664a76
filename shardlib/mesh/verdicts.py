"""Fatal verdicts of the watchdog's diagnosis, shared through the ``torch.distributed`` store.

A verdict is published under its diagnosis generation ``gen`` with the ranks expected to read
it, then listed in publication order (``f"{_VLIST}/{k}"``, k = 1, 2, ...), so a reader takes
each one exactly once, in order, whenever it polls. Each reader acknowledges what it reads under a
key of its own (``f"{DIAG}/{gen}/ack/{rank}"``): a rank blocked in a point-to-point wait ends its
process only once its expected readers hold the verdict (:mod:`shardlib.mesh.watchdog`), so a
peer whose wait then fails raises the verdict instead of a new "rank is gone". A verdict counted
but never listed (its publisher interrupted in between) is passed after ``_UNLISTED_S``.
"""

from __future__ import annotations

import json
import threading
import time

__all__ = ["DIAG", "Verdicts"]

DIAG = "shardlib/diag"  # f"{DIAG}/{gen}/{rank}": a rank's state for diagnosis ``gen``; f"{DIAG}/{gen}/verdict"
_VCOUNT = "shardlib/diag/verdicts"  # how many verdicts have been counted
_VLIST = "shardlib/diag/verdict"  # f"{_VLIST}/{k}": the generation of the k-th verdict
_UNLISTED_S = 5.0  # s a counted verdict may stay unlisted before readers pass it


class Verdicts:
    """This rank's view of the published verdicts (thread-safe: the answering thread polls, the
    main thread reads on a failed wait).

    Args:
        store: the ``torch.distributed`` store every rank shares.
        rank, world: this rank and the world size.
    """

    def __init__(self, store, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world
        self._seen = int(store.add(_VCOUNT, 0))  # verdicts read (or published before this process came)
        self._published: set[int] = set()  # generations of the verdicts this rank published
        self._readers: dict[int, list[int]] = {}  # generation -> the ranks expected to acknowledge it
        self._unlisted: tuple[int, float] | None = None  # (k, since) of a counted verdict not listed yet
        self._lock = threading.Lock()

    def publish(self, gen: int, cls: str, text: str, readers: list[int]) -> None:
        """Publish verdict ``gen`` (error class name ``cls``, message ``text``) for ``readers``."""
        self._published.add(gen)  # before it is listed: this rank does not acknowledge its own
        self._readers[gen] = readers
        self.store.set(f"{DIAG}/{gen}/verdict", json.dumps([cls, text, readers]))
        self.store.set(f"{_VLIST}/{int(self.store.add(_VCOUNT, 1))}", str(gen))

    def read(self) -> list[tuple[int, str, str]]:
        """The verdicts published since the last call, ``(gen, cls, text)`` in listed order, each
        acknowledged (those of other ranks). A store that is gone (its host ended) ends the
        reading in silence."""
        store, out = self.store, []
        with self._lock:
            try:
                count = int(store.add(_VCOUNT, 0))
                while self._seen < count:
                    k = self._seen + 1
                    key = f"{_VLIST}/{k}"
                    if not store.check([key]):  # counted, not listed yet: read it next time, unless its
                        if self._unlisted is None or self._unlisted[0] != k:  # publisher never lists it
                            self._unlisted = (k, time.monotonic())
                        if time.monotonic() - self._unlisted[1] < _UNLISTED_S:
                            break
                        self._seen = k
                        continue
                    g = int(store.get(key))
                    cls, text, *readers = json.loads(store.get(f"{DIAG}/{g}/verdict"))
                    if readers:
                        self._readers[g] = readers[0]
                    self._seen = k
                    if g not in self._published:  # one key per rank: a repeated acknowledgement counts once
                        store.set(f"{DIAG}/{g}/ack/{self.rank}", "1")
                    out.append((g, cls, text))
            except Exception:  # noqa: BLE001 - the store went away with its host
                pass
        return out

    def acknowledged(self, gen: int) -> bool:
        """Whether every rank expected to read verdict ``gen`` has read it (all others, for a
        verdict whose readers this rank does not know). False if the store is gone."""
        readers = self._readers.get(gen, [r for r in range(self.world) if r != self.rank])
        try:
            return not readers or self.store.check([f"{DIAG}/{gen}/ack/{r}" for r in readers])
        except Exception:  # noqa: BLE001 - the store went away with its host
            return False
