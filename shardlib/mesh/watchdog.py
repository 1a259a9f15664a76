"""Bounded waits on collectives, and the diagnosis of ranks that stopped doing the same thing.

Every wait on a gloo collective goes through :meth:`Watchdog.wait`. It waits in slices of a
second; after ``SHARDLIB_WATCHDOG`` seconds (default 30) without completion it asks every rank,
out of band through the ``torch.distributed`` store, for its state: the collective it is
blocked in, where its main thread is, its step and its last collectives from the trace
(:mod:`shardlib.mesh.trace`). Each process runs a small thread that answers (it polls the store
once a second), so a rank that is busy, idle or blocked answers, and a rank that does not is
probed by pid (``/proc``: gone, or stopped by SIGSTOP) and named as the lost one, not its
neighbour. :func:`~shardlib.mesh.diagnosis.analyze` turns the states into one message; when it
is fatal (a rank lost, or the ranks' collectives differ and nobody is on their way) it is
published in the store and every blocked rank raises it within a second (each rank's answering
thread acknowledges every verdict it reads: :mod:`shardlib.mesh.verdicts`; the ranks'
registrations and ``/proc`` probes are :mod:`shardlib.mesh.peers`). A wait that fails
(gloo's ``Connection closed by peer``) is diagnosed at once and raised as
:class:`~shardlib.errors.RankFailureError` naming the rank, host and pid that is gone.
``SHARDLIB_TIMEOUT`` still bounds every wait. Blocking calls that shardlib does not issue
itself (DCP's collectives in a checkpoint, ``all_gather_object``) run on a helper thread while
the main thread waits the same way (:meth:`Watchdog.call`).

Waits on gloo collectives (``all_reduce``, ``broadcast``, ``all_gather_into_tensor``) are
sliced directly: an expired slice leaves the collective running. A gloo point-to-point wait
that expires closes the connection, so the main thread waits for a point-to-point work
directly, under what is left of ``SHARDLIB_TIMEOUT`` (no thread between gloo's and the main
thread: a pipeline receive wakes the main thread as torch's own schedules do), and the
answering thread watches it: after ``SHARDLIB_WATCHDOG`` seconds it diagnoses as a sliced wait
does. A fatal verdict is published (every other rank raises it); a peer that is gone or raises
closes the connection, so the blocked wait fails and raises the verdict; if it is still blocked
once every other rank has read the verdict (so a peer whose wait fails when this process ends
raises the verdict, not a new "rank is gone"), or at most ``_GRACE`` seconds after it (a rank
that never reads it: frozen or gone), nothing can interrupt it (the peer frozen, or blocked in a
point-to-point wait of its own), so the process ends with the verdict (:attr:`Watchdog.on_fatal`: a
:func:`~shardlib.mesh.launch.launch` worker reports it as its error; otherwise it is written to
stderr and to torchrun's error file, and the process exits with status 1). On NCCL a wait orders
CUDA streams and returns at once: nothing here blocks the host there (the NCCL watchdog bounds
the collective itself).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time

from ..errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, RankFailureError
from .diagnosis import analyze
from .helper_call import HelperCall
from .mesh import env_seconds
from .peers import Peers
from .trace import Trace, is_library
from .verdicts import DIAG as _DIAG, Verdicts

__all__ = ["Watchdog", "process_watchdog", "watchdog_seconds"]

_CLASSES = {c.__name__: c for c in (CollectiveError, CollectiveMismatchError, CollectiveTimeoutError, RankFailureError)}
_GEN = "shardlib/diag/gen"
_UNREAD = ("stopped", "gone", "exited")  # a rank in one of these states can never read a verdict
_SLICE = 1.0
_POLL = 1.0
_GRACE = 3.0  # s at most a point-to-point wait may take to fail after a fatal verdict before the process ends
_RECORDS = 128
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def watchdog_seconds() -> float:
    """Seconds a collective may wait before the ranks are asked for their states
    (``SHARDLIB_WATCHDOG``, default 30); read when a mesh is made.

    Raises:
        ShardingError: the variable is not a positive number, naming it."""
    return env_seconds("SHARDLIB_WATCHDOG", "30")


def _is_slice_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text and "pair closure" not in text


class Watchdog:
    """The waits, the answering thread and the diagnosis of one process (see the module doc).

    Args:
        trace: this process's :class:`~shardlib.mesh.trace.Trace`.
        store: the ``torch.distributed`` store every rank shares.
        rank, world: this rank and the world size.
    """

    def __init__(self, trace: Trace, store, rank: int, world: int):
        self.trace, self.store, self.rank, self.world = trace, store, rank, world
        self.host = socket.gethostname()
        self.read_settings()
        self.verdict: tuple[int, str, str] | None = None
        self.handled = 0
        # a point-to-point wait of the main thread, watched by the answering thread: (record, start),
        # and the answering thread's view of it (the wait it watches, its next diagnosis, noted once)
        self._blocked: tuple | None = None
        self._watching, self._next_check, self._noted = None, 0.0, False
        self.on_fatal = _end_process  # (class name, message) -> never returns; see the module doc
        self._main = threading.main_thread().ident
        self._lock = threading.Lock()
        self._answered = int(store.add(_GEN, 0))
        self.verdicts = Verdicts(store, rank, world)
        self.peers = Peers(store, rank, self.host, trace.path or "")
        self._broken: tuple[str, str] | None = None  # a lost rank named by this rank's first failed collective
        import atexit

        atexit.register(self._at_exit)  # after init_mesh's destroy_process_group: runs before it (LIFO)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardlib-watchdog", daemon=True)
        self._thread.start()

    # -- the wait ---------------------------------------------------------------------------------
    def wait(self, works, rec: dict | None, timeout: datetime.timedelta, p2p: bool) -> None:
        """Wait for ``works`` (gloo), raising a :class:`CollectiveError` that names the ranks and
        collectives if they cannot complete.

        ``p2p``: gloo point-to-point works, waited for directly on this thread (a timed-out
        point-to-point wait closes the connection, so it cannot be sliced), watched by the
        answering thread (see the module doc).

        Raises:
            CollectiveMismatchError: the ranks' collectives differ, or a rank stopped issuing them.
            RankFailureError: a rank is gone or frozen.
            CollectiveTimeoutError: ``timeout`` passed while a rank was busy elsewhere.
        """
        if p2p:
            return self._wait_direct(works, rec, timeout)
        next_check = self.seconds
        start = time.monotonic()
        limit = timeout.total_seconds()
        self.trace.waiting = (rec, start)
        last, noted = None, False
        try:
            pending = list(works)
            while True:
                try:
                    while pending:
                        pending[0].wait(datetime.timedelta(seconds=_SLICE))
                        pending.pop(0)
                    return
                except CollectiveError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a slice ended, or the collective failed
                    if _is_slice_timeout(exc):
                        if not pending[0].is_completed():
                            pass  # a slice: the collective runs on
                        else:
                            try:  # it ended just after the slice: a second wait returns, or raises how it ended
                                pending[0].wait(datetime.timedelta(seconds=_SLICE))
                                pending.pop(0)
                                continue
                            except Exception as again:  # noqa: BLE001 - it failed (a real timeout, a peer gone)
                                self._failed(again, start, limit, "a collective", last)
                    else:
                        self._failed(exc, start, limit, "a collective", last)
                self._raise_verdict()
                waited = time.monotonic() - start
                if waited >= next_check:
                    fatal, cls, text = self.diagnose(finished=lambda: all(w.is_completed() for w in pending))
                    last = text
                    if fatal:
                        raise _CLASSES.get(cls, CollectiveError)(text)
                    if not noted:  # once per wait
                        noted = True
                        sys.stderr.write(f"shardlib rank {self.rank}: a collective has waited {waited:.0f} s:\n{text}\n")
                    next_check = waited + self.seconds
                if waited >= limit:
                    raise CollectiveTimeoutError(
                        f"a collective waited the whole timeout of {limit:.0f} s (SHARDLIB_TIMEOUT) on rank {self.rank}"
                        + (f":\n{last}" if last else ""))
        finally:
            self.trace.waiting = None

    def _failed(self, exc: BaseException, start: float, limit: float, what: str, last: str | None):
        """A wait that started at ``start`` raised ``exc``: the backend's own timeout (the same
        ``SHARDLIB_TIMEOUT``) as a :class:`CollectiveTimeoutError`, anything else through
        :meth:`fail` (never returns)."""
        text = str(exc).lower()
        if ("timed out" in text or "timeout" in text) and time.monotonic() - start >= 0.9 * limit:
            raise CollectiveTimeoutError(f"{what} waited the whole timeout of {limit:.0f} s (SHARDLIB_TIMEOUT) on rank "
                                         f"{self.rank}" + (f":\n{last}" if last else "")) from exc
        self.fail(exc)

    def fail(self, exc: BaseException):
        """A collective failed on this rank (gloo's ``Connection closed by peer``): ask the
        others, name who is gone, and raise that as a :class:`CollectiveError` (never returns).
        A verdict already published (the peer ended after a diagnosis) is raised instead, and once
        a rank is named gone or frozen (it never comes back to this group), a later failure (a
        clean-up waiting for a collective of the broken group) raises that verdict again at once,
        without asking the others a second time."""
        try:
            self.read_verdicts()
        except Exception:  # noqa: BLE001 - the store went away: diagnose() below says so
            pass
        self._raise_verdict()
        if self._broken is not None:
            cls, text = self._broken
        else:
            try:
                fatal, cls, text = self.diagnose(lost=True)
            except Exception as store_exc:  # noqa: BLE001 - its host ended (torchrun's agent, rank 0's node)
                cls, text = "RankFailureError", (
                    f"a collective failed on rank {self.rank}, and the store the ranks share to name each other is "
                    f"unreachable ({type(store_exc).__name__}: {str(store_exc)[:200]}): the host that holds it ended "
                    "(rank 0's node, or torchrun's rendezvous), so the lost ranks cannot be named. Fix: read the "
                    "other nodes' logs for why they ended; restart from the last finished checkpoint")
            if cls == "RankFailureError":
                self._broken = (cls, text)
        raise _CLASSES.get(cls, CollectiveError)(
            f"{text}\n(the backend said on rank {self.rank}: {type(exc).__name__}: {str(exc)[:300]})") from exc

    def _wait_direct(self, works, rec: dict | None, timeout: datetime.timedelta) -> None:
        """Wait for gloo point-to-point ``works`` on this thread, each under what is left of
        ``timeout``, watched by the answering thread (see the module doc and :meth:`_watch`)."""
        self._raise_verdict()
        start = time.monotonic()
        limit = timeout.total_seconds()
        blocked = (rec, start)
        self.trace.waiting = blocked
        self._blocked = blocked
        try:
            for w in works:
                w.wait(datetime.timedelta(seconds=max(limit - (time.monotonic() - start), 1e-3)))
        except CollectiveError:
            raise
        except Exception as exc:  # noqa: BLE001 - a peer is gone, raised, or the timeout passed
            self._blocked = None  # at once: the answering thread's grace for this wait ends here
            self._raise_verdict()  # the answering thread's verdict, or another rank's
            self._failed(exc, start, limit, "a point-to-point transfer", None)
        finally:
            self._blocked = None
            self.trace.waiting = None

    def _watch(self) -> None:
        """The answering thread's part of a point-to-point wait of the main thread: diagnose it
        every ``SHARDLIB_WATCHDOG`` seconds; on a fatal verdict (this rank's diagnosis or another
        rank's), give the wait a few polls to fail (a peer that raises or is gone closes the
        connection), then end the process with the verdict (:attr:`on_fatal`)."""
        blocked = self._blocked
        if blocked is None:
            return
        waited = time.monotonic() - blocked[1]
        if self._watching is not blocked:
            self._watching, self._next_check, self._noted = blocked, self.seconds, False
        verdict = self.verdict if self.verdict is not None and self.verdict[0] > self.handled else None
        if verdict is None and waited >= self._next_check:
            fatal, cls, text = self.diagnose(finished=lambda: self._blocked is not blocked, own=False)
            if fatal:
                verdict = self.verdict
            elif not self._noted:
                self._noted = True
                sys.stderr.write(f"shardlib rank {self.rank}: a point-to-point transfer has waited {waited:.0f} s:\n{text}\n")
            self._next_check = waited + self.seconds
        if verdict is None:
            return
        deadline = time.monotonic() + _GRACE
        while time.monotonic() < deadline:
            if self._blocked is not blocked:
                return  # the wait ended: the main thread raises the verdict itself
            if self.verdicts.acknowledged(verdict[0]):
                break  # every other rank holds it: a peer whose wait fails when we end raises it
            self.read_verdicts()  # and acknowledge theirs: two ranks in this loop wait for each other
            time.sleep(0.05)
        self.on_fatal(verdict[1], verdict[2])

    def call(self, fn, rec: dict, timeout: datetime.timedelta, collective: bool = False):
        """Run ``fn()``, blocking ``torch.distributed`` calls that shardlib does not issue itself
        (DCP's, ``all_gather_object``), on a helper thread while this thread waits as in
        :meth:`wait` under the record ``rec``: a frozen or lost peer is named within
        ``SHARDLIB_WATCHDOG`` seconds instead of after the backend's timeout. If a fatal verdict
        is raised, the helper thread is left blocked in the backend (the group is unusable).

        Args:
            fn: the call; its result is returned and its exception re-raised here.
            rec: its trace record (what the other ranks are told this rank waits in).
            timeout: the most it may wait (``SHARDLIB_TIMEOUT``).
            collective: an ``Exception`` of ``fn`` comes from a failed collective: it is
                diagnosed as one (a :class:`RankFailureError` naming the rank that is gone);
                otherwise (and always for a ``BaseException`` that is not an ``Exception``) it
                is re-raised as it is.

        Raises:
            CollectiveError: as :meth:`wait`.
        """
        work = HelperCall(fn, collective)
        self.wait([work], rec, timeout, p2p=False)
        if work.error is not None:
            raise work.error
        return work.result

    def read_settings(self) -> None:
        """Read ``SHARDLIB_WATCHDOG`` and ``SHARDLIB_WATCHDOG_ANSWER`` (every mesh made calls
        this, so a value set before ``init_mesh`` applies; the waits read no environment)."""
        self.seconds = watchdog_seconds()
        self.answer_s = env_seconds("SHARDLIB_WATCHDOG_ANSWER", "10")

    def _raise_verdict(self) -> None:
        v = self.verdict
        if v is not None and v[0] > self.handled:
            self.handled = v[0]
            raise _CLASSES.get(v[1], CollectiveError)(v[2])

    def new_task(self) -> None:
        """Forget verdicts of an earlier task (the test pool reuses processes)."""
        if self.verdict is not None:
            self.handled = max(self.handled, self.verdict[0])
        self._broken = None
        self.trace.new_task()

    # -- states ------------------------------------------------------------------------------------
    def state(self) -> dict:
        """This rank's state for the diagnosis (see :mod:`shardlib.mesh.diagnosis`)."""
        tr = self.trace
        waiting = tr.waiting
        frame, in_dist = self._main_frame()
        out = {"rank": self.rank, "host": self.host, "pid": os.getpid(), "step": tr.step, "frame": frame,
               "records": tr.records(_RECORDS), "waiting": None, "waited_s": 0.0}
        if waiting is not None and waiting[0] is not None:
            out.update(status="waiting", waiting=waiting[0], waited_s=time.monotonic() - waiting[1])
        elif tr.status == "returned" or tr.status.startswith("raised"):
            out["status"], out["how"] = "returned", tr.status
        elif in_dist or waiting is not None:
            out["status"] = "untraced"
        else:
            out["status"] = "busy"
        return out

    def _main_frame(self) -> tuple[str, bool]:
        f = sys._current_frames().get(self._main)
        in_dist = False
        inner = True
        while f is not None:
            fn = f.f_code.co_filename
            if inner and "torch" in fn and "distributed" in fn:
                in_dist = True
            inner = inner and (fn.startswith(_PKG_DIR) or "torch" in fn)
            if not is_library(fn):
                return f"{os.path.basename(fn)}:{f.f_lineno} in {f.f_code.co_name}", in_dist
            f = f.f_back
        return "?", in_dist

    def diagnose(self, lost: bool = False, finished=None, own: bool = True) -> tuple[bool, str, str]:
        """Ask every rank for its state through the store and analyze them.

        Args:
            lost: this rank's own collective failed (a peer is gone): answers are awaited for
                half as long, and the verdict is fatal whatever the others say.
            finished: ``() -> bool``, whether this rank's wait completed meanwhile (the states are
                a few seconds old by the end): a fatal verdict is then dropped, not published.
            own: the caller raises a fatal verdict itself (the main thread); ``False`` (the
                answering thread, for a point-to-point wait of the main thread): it becomes
                :attr:`verdict`, which the main thread raises.

        Returns:
            ``(fatal, error class name, message)``; a fatal verdict is also published, so every
            blocked rank raises it. A verdict another rank publishes while the answers are awaited
            is returned instead (it is not published again).
        """
        store = self.store
        gen = int(store.add(_GEN, 1))
        mine = self.state()
        store.set(f"{_DIAG}/{gen}/{self.rank}", json.dumps(mine))
        states = {self.rank: mine}
        deadline = time.monotonic() + (self.answer_s / 2 if lost else self.answer_s)
        while len(states) < self.world and time.monotonic() < deadline:
            # another rank's verdict published meanwhile (it diagnosed the same stall, and may not answer:
            # its answering thread waits for our acknowledgement) stands, acknowledged, instead of ours
            self.read_verdicts()
            with self._lock:
                theirs = self.verdict if self.verdict is not None and self.verdict[0] > self.handled else None
                if theirs is not None and own:
                    self.handled = theirs[0]  # the caller raises it
            if theirs is not None:
                return True, theirs[1], theirs[2]
            for r in range(self.world):
                key = f"{_DIAG}/{gen}/{r}"
                if r not in states and store.check([key]):
                    states[r] = json.loads(store.get(key))
                elif r not in states and self.peers.exited(r):
                    states[r] = self.peers.probe(r, _RECORDS)  # it will not answer
            if len(states) < self.world:
                time.sleep(0.05)
        for r in range(self.world):
            if r not in states:
                states[r] = self.peers.probe(r, _RECORDS)
        fatal, cls, text = analyze(states, self.world)
        if lost and not fatal:  # our own wait failed: the pair is closed whatever the others say
            fatal, cls = True, "RankFailureError" if cls == "RankFailureError" else "CollectiveError"
        if fatal and not lost and finished is not None and finished():
            return False, cls, text  # the collective completed while the states were gathered: not stuck
        if fatal:
            # the ranks expected to read it: every other rank not found stopped, gone or exited (a silent
            # rank may be alive: it is waited for, up to the grace)
            self.verdicts.publish(gen, cls, text, sorted(r for r, st in states.items()
                                                         if r != self.rank and st.get("status") not in _UNREAD))
            with self._lock:
                if own:
                    self.handled = max(self.handled, gen)
                elif gen > self.handled:
                    self.verdict = (gen, cls, text)
        return fatal, cls, text

    # -- the answering thread ----------------------------------------------------------------------
    def _run(self) -> None:
        store = self.store
        while not self._stop.wait(_POLL):
            try:
                gen = int(store.add(_GEN, 0))
                if gen > self._answered:
                    text = json.dumps(self.state())
                    for g in range(self._answered + 1, gen + 1):
                        store.set(f"{_DIAG}/{g}/{self.rank}", text)
                    self._answered = gen
                self.read_verdicts()
                self._watch()
            except Exception:  # noqa: BLE001 - the store went away (its host ended): keep quiet
                self._stop.wait(5 * _POLL)  # not sleep: _at_exit's join must not time out on it

    def read_verdicts(self) -> None:
        """Read (and acknowledge) the verdicts other ranks published since the last call, and keep
        the newest not yet handled as :attr:`verdict` (the main thread raises it)."""
        for g, cls, text in self.verdicts.read():
            with self._lock:
                if g > self.handled and (self.verdict is None or g > self.verdict[0]):
                    self.verdict = (g, cls, text)

    def _at_exit(self) -> None:
        # stop the polling thread first: left inside a store call while the process group and the
        # store are destroyed, it let C++ threads die joinable ("terminate called without an active
        # exception", SIGABRT after the last step: 2 of 71 two-rank runs under load)
        self._stop.set()
        self._thread.join(timeout=2 * _POLL + 1)
        # an exception nothing caught (the interpreter printed it and set sys.last_value before
        # the exit handlers): the others then name it, not "exited normally"
        err = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        raised = None if err is None else f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
        try:
            self.peers.record_exit(self.trace.step, self.trace.records(_RECORDS), raised)
        except Exception:  # noqa: BLE001
            pass


def _end_process(cls: str, text: str) -> None:
    """:attr:`Watchdog.on_fatal` outside a launch worker: the verdict to stderr and, under
    torchrun, to the worker's error file (torchrun then names it as the root cause; a file
    already there is left alone), then ``os._exit(1)``."""
    import traceback

    main = sys._current_frames().get(threading.main_thread().ident)
    stack = "".join(traceback.format_stack(main)) if main is not None else ""
    sys.stderr.write(f"shardlib: {cls}: {text}\n(shardlib's watchdog ends this process: its main thread is blocked in "
                     "a point-to-point wait that nothing can interrupt)\n")
    sys.stderr.flush()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and not os.path.exists(path):
        try:
            with open(path, "w") as f:
                json.dump({"message": {"message": f"{cls}: {text}",
                                       "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))}}}, f)
        except OSError:
            pass
    os._exit(1)


_PROCESS: dict = {}


def process_watchdog(mesh) -> tuple[Trace, Watchdog | None]:
    """The trace and watchdog of this process, made on first use (one per default group)."""
    import torch.distributed as dist

    key = dist.group.WORLD if dist.is_initialized() else None  # the group, not its id (reused after a destroy)
    got = _PROCESS.get(key)
    if got is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        trace = Trace(rank, path=None if world > 1 else "")
        dog = None
        if world > 1 and dist.get_backend() != "fake":  # a fake group has no peers, and FakeStore no add()
            from torch.distributed.distributed_c10d import _get_default_store

            dog = Watchdog(trace, _get_default_store(), rank, world)
        got = _PROCESS[key] = (trace, dog)
    elif got[1] is not None:
        got[1].read_settings()
    return got
