"""Local multi-process runs on CPU: ``launch`` and the reusable worker group behind it.

Each worker is a process started from a fork server that imported torch and shardlib once
(spawned where there is none) with ``OMP_NUM_THREADS=1`` that joins a gloo process group
through a ``FileStore`` in a fresh temporary directory (no ports to race for). Functions and
arguments travel with ``cloudpickle``, so functions defined in a notebook or a test work.

Failure semantics: when a rank raises, the others get a short grace period to report; if any
rank is still busy after it (waiting in a collective for the rank that failed), every worker is
killed at once, and :class:`~shardlib.errors.WorkerError` carries the failing rank's message and
traceback. Nothing waits for a collective timeout to learn that a peer is gone, nor for a
stopped worker (``SIGSTOP``, a debugger) that can neither report nor exit.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait as _wait_conns
from typing import Any, Callable

from ..errors import WorkerError
from . import transport
from .peers import proc_status

__all__ = ["launch", "WorkerGroup"]

_FATAL = ("ProcessExit", "CollectiveError", "CollectiveMismatchError", "RankFailureError", "CollectiveTimeoutError")
_LOST_GRACE = 45.0  # s after a worker died: the survivors' diagnosis (watchdog 30 s + answers) comes within it
_UNGUARDED_EXIT = 3  # a worker's exit code when the main script starts workers at import time
_UNGUARDED = (
    "the main script calls shardlib.launch() (or starts a WorkerGroup) when it is imported: the workers "
    "are spawned processes, and each one imports the main script again before it can run anything, so "
    "that call would start workers from inside a worker. Fix: put the call under "
    "`if __name__ == \"__main__\":` (Python's multiprocessing requires this for the spawn start method)"
)


# what gloo (and NCCL) raise on a rank whose peer closed the connection: the consequence of that
# peer's own failure, never a cause to report first
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
              "NCCL communicator was aborted")


def _peer_lost(exc_type: str, message: str) -> bool:
    """Whether a worker's ``exc_type: message`` is a backend's lost connection to a peer."""
    return exc_type in ("RuntimeError", "DistBackendError") and any(s in message for s in _PEER_LOST)


def _stopped(proc) -> bool:
    """Whether worker ``proc`` is stopped (``SIGSTOP``, a debugger's stop; Linux only)."""
    return proc_status(proc.pid) == "stopped"


def _context():
    """The start method of the workers: a fork server that imported torch and shardlib once
    (each worker then starts in well under a second instead of importing torch itself, ~3 s for
    2 ranks and ~6 s for 4 on a 2-core machine) on Linux; spawn elsewhere. It imports
    ``torch._dynamo`` too: creating any torch optimizer imports it (``Optimizer.__init__`` is
    wrapped by ``torch._disable_dynamo``), 1.4-1.8 s of CPU in each worker that did it itself
    (a dp=4 save of notebook 04 took 9.8 s, 0.7 s with it preloaded; the notebook 27.7 s, 14.1 s).

    Both run the parent's ``__main__`` again in each worker (so a script must guard its
    ``launch()`` call), and each worker takes the parent's environment as it is at start.
    The server starts inside the ``OMP_NUM_THREADS=1`` window of the first group, so the
    OpenMP runtime torch loads there has one thread. It keeps the torch and shardlib it
    imported for the life of the parent process (a notebook kernel: restart it after editing
    shardlib itself; the user's own functions travel with each call).

    :data:`EXTRA_PRELOAD` (module names, read when the server starts) adds modules the server
    imports too, for the heavy imports of the functions you run: each worker imports the module a
    pickled function belongs to, with everything that module imports (``transformers`` models:
    about 2 s of CPU per worker; the test suite preloads them). A name that fails to import
    there is skipped (the worker then imports it itself, or raises)."""
    if not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")  # macOS: forking a process that loaded torch is not fork-safe there
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "shardlib", "torch._dynamo", *EXTRA_PRELOAD])
    return ctx


EXTRA_PRELOAD: list[str] = []
"""Modules the workers' fork server imports besides torch and shardlib (see :func:`_context`);
set before the first :class:`WorkerGroup` (or :func:`launch`) of the process."""


def _start_forkserver(ctx) -> None:
    """Start ``ctx``'s fork server (if it is one and not running yet) from the folder that holds
    this shardlib package. The server runs ``python -c``, so the current folder comes first on
    its ``sys.path`` while it imports its preloads (Python before 3.13 applies the parent's path
    only to the children), and a folder named ``shardlib`` there (a checkout's root, seen from
    its parent folder) was imported instead of the package: every worker then failed with
    ``module 'shardlib' has no attribute 'init_mesh'``. Workers change to the parent's folder
    themselves (:func:`_worker_main`)."""
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    here = os.getcwd()
    os.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        forkserver.ensure_running()
    finally:
        os.chdir(here)


def _worker_main(rank: int, world: int, store_path: str, timeout_s: float, conn, env: dict | None = None,
                 cwd: str | None = None) -> None:
    if env is not None:  # forked from the fork server: the parent's environment now, not the server's at its start
        os.environ.clear()
        os.environ.update(env)
    if cwd is not None:  # the parent's folder now (the fork server's is where it started: _start_forkserver)
        try:
            os.chdir(cwd)
        except OSError:
            pass
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["SHARDLIB_TIMEOUT"] = str(timeout_s)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    os.environ.setdefault("SHARDLIB_TRACE_DIR", os.path.dirname(store_path))
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    from .watchdog import process_watchdog

    trace, dog = process_watchdog(None)  # answers the others' diagnosis from now on
    if dog is not None:
        def fatal(cls: str, text: str) -> None:  # the main thread is blocked for good: report, then end
            trace.set_status(f"raised {cls}")
            conn.send(("err", (cls, text, "raised by shardlib's watchdog thread: the main thread was blocked in a "
                                          "point-to-point wait that nothing can interrupt\n")))
            os._exit(1)

        dog.on_fatal = fatal
    task_sigint = signal.getsignal(signal.SIGINT)  # as the worker started (ignored when launched in the background)
    conn.send(("ready", None))
    while True:
        # idle: an interrupt sent to the parent's whole process group (Ctrl-C in a terminal, a
        # notebook's Interrupt or shutdown) leaves the worker waiting, without a traceback; the
        # parent's exit still ends it (EOF or None). A task is interruptible as the worker
        # started; its reply is not (a message cut in half would break the pipe).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        trace.set_status("running")
        if dog is not None:
            dog.new_task()
        try:
            signal.signal(signal.SIGINT, task_sigint)
            try:
                fn, args, kwargs, path = transport.loads(msg)
                for p in path:
                    if p not in sys.path:
                        sys.path.append(p)
                result = fn(*args, **kwargs)
            finally:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
            trace.set_status("returned")
            reply = ("ok", transport.dumps(result))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent with the traceback
            trace.set_status(f"raised {type(exc).__name__}")
            reply = ("err", (type(exc).__name__, str(exc), traceback.format_exc()))
        conn.send(reply)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class WorkerGroup:
    """``nprocs`` spawned worker processes joined in one gloo process group, reused across runs.

    Args:
        nprocs: number of ranks (world size).
        timeout: seconds a collective may take inside the workers (``SHARDLIB_TIMEOUT``).

    ``run(fn, *args)`` calls ``fn(*args)`` on every rank and returns the list of results by rank.
    After a failure that leaves a rank stuck, the group is closed; ``alive`` tells.
    """

    def __init__(self, nprocs: int, timeout: float = 120.0):
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"nprocs must be an int >= 1 (the number of worker processes, one per rank), got {nprocs!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or timeout != timeout:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r} (the collective timeout "
                             "inside the workers, SHARDLIB_TIMEOUT)")
        if getattr(mp.process.current_process(), "_inheriting", False):  # a spawned child importing __main__
            sys.stderr.write(f"shardlib: {_UNGUARDED}\n")
            sys.stderr.flush()
            os._exit(_UNGUARDED_EXIT)  # the parent reads the code and names the cause (a fork server's child
            # turns SystemExit into exit code 1)
        self.nprocs = nprocs
        self.timeout = timeout
        self._running = False  # a run was started and not collected (start())
        self._dir = tempfile.mkdtemp(prefix="shardlib-")
        ctx = _context()
        self._conns, self._procs = [], []
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        # spawn re-runs the parent's __main__ file in each child; a script read from stdin or -c
        # has none (functions travel by cloudpickle anyway), so hide a __file__ that does not exist
        main = sys.modules.get("__main__")
        hidden = getattr(main, "__file__", None)
        if hidden is not None and not os.path.exists(hidden):
            del main.__file__
        else:
            hidden = None
        try:
            _start_forkserver(ctx)
            for rank in range(nprocs):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main,
                    args=(rank, nprocs, os.path.join(self._dir, "store"), timeout, child, dict(os.environ), os.getcwd()),
                    daemon=True,
                )
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
        finally:
            if hidden is not None:
                main.__file__ = hidden
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
        self.alive = True
        self._collect(None, startup=True)

    def run(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; results in rank order.

        Raises:
            WorkerError: a rank raised (the lowest failing rank is named, a rank's own error or
                death before the collective errors it caused on the others; ``errors`` has all
                of them), died, or did not answer within ``timeout`` seconds (default: the
                group's collective timeout plus a minute).
        """
        return self.start(fn, *args, timeout=timeout, **kwargs)()

    def start(self, fn: Callable, *args: Any, timeout: float | None = None, **kwargs: Any) -> Callable[[], list]:
        """Send ``fn(*args, **kwargs)`` to every rank and return at once, so the caller can work
        while the ranks run (the test harness computes its single-process reference meanwhile).
        The returned function waits for the results as :meth:`run` does (``timeout`` counted
        from now) and must be called before the next run.

        Raises:
            RuntimeError: the group was closed, or an earlier ``start`` was not collected.
        """
        if not self.alive:
            raise RuntimeError("this WorkerGroup was closed after a failure; make a new one")
        if self._running:
            raise RuntimeError("a run started on this WorkerGroup was not collected: call the function start() "
                               "returned before starting another")
        payload = transport.dumps((fn, args, kwargs, list(sys.path)))
        for conn in self._conns:
            conn.send(payload)
        self._running = True
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout + 60)

        def collect() -> list:
            if not self._running:
                raise RuntimeError("this run's results were already collected")
            try:
                return self._collect(max(0.0, deadline - time.monotonic()))
            finally:
                self._running = False

        return collect

    def _collect(self, timeout, startup=False):
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[int, Any] = {}
        errors: dict[int, tuple[str, str, str]] = {}
        pending = dict(enumerate(self._conns))
        grace_end = None
        while pending:
            now = time.monotonic()
            limit = min(x for x in (deadline, grace_end, now + 3600) if x is not None)
            if grace_end is not None and all(_stopped(self._procs[r]) for r in pending):
                break  # a rank has failed and the others cannot report
            # in the grace period, look again for stopped ranks every 0.25 s
            ready = _wait_conns(list(pending.values()),
                                timeout=max(0.0, (min(limit, now + 0.25) if grace_end is not None else limit) - now))
            if not ready:
                if grace_end is not None and time.monotonic() < limit:
                    continue
                break  # deadline or grace period over
            for conn in ready:
                rank = next(r for r, c in pending.items() if c is conn)
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    self._procs[rank].join(timeout=1)
                    code = self._procs[rank].exitcode
                    how = f"exit code {code}"
                    if code == _UNGUARDED_EXIT and startup:
                        errors[rank] = ("ProcessExit", f"worker process exited at start: {_UNGUARDED}", "")
                        del pending[rank]
                        continue
                    if code is not None and code < 0:
                        import signal

                        how = f"killed by {signal.Signals(-code).name}" + (
                            " (a native crash; the worker's stderr has the backend's message)" if -code in (6, 11) else "")
                    errors[rank] = ("ProcessExit", f"worker process exited ({how}){self._last_collectives(rank)}", "")
                    del pending[rank]
                    if grace_end is None:  # the survivors' watchdog names the dead rank: give them time to say so
                        grace_end = time.monotonic() + _LOST_GRACE
                    continue
                del pending[rank]
                if kind == "ok":
                    results[rank] = transport.loads(value)
                elif kind == "ready":
                    results[rank] = None
                else:
                    errors[rank] = value
                    if grace_end is None:
                        grace_end = time.monotonic() + 5.0
        if pending or errors:
            if any(kind == "ProcessExit" for kind, _, _ in errors.values()):
                diff = self._difference()  # a native abort (gloo's size check) leaves only the traces to say why
                if diff:
                    errors = {r: (t, m + ("\n" + diff if t == "ProcessExit" else ""), tb) for r, (t, m, tb) in errors.items()}
            if pending or any(kind in _FATAL for kind, _, _ in errors.values()):
                self.close()  # a rank is stuck or gone, or the collectives are out of step: the group cannot run again
            if errors:  # the cause before its consequences: a rank's own error or death, then the collective
                # errors (diagnoses), then a backend's lost connection (the peer that raised closed it)
                tiers = ([r for r, (t, m, _) in errors.items() if t not in _FATAL[1:] and not _peer_lost(t, m)],
                         [r for r, (t, _, _) in errors.items() if t in _FATAL[1:]], list(errors))
                first = min(next(tier for tier in tiers if tier))
                exc_type, message, tb = errors[first]
                summary = {r: (t, m) for r, (t, m, _) in sorted(errors.items())}
                if pending:
                    message += f" (ranks {sorted(pending)} were still running and were stopped)"
                raise WorkerError(first, exc_type, message, tb, summary)
            what = "start" if startup else "finish"
            raise WorkerError(
                min(pending),
                "TimeoutError",
                f"ranks {sorted(pending)} did not {what} within {timeout} s; all workers were stopped",
            )
        return [results[r] for r in range(self.nprocs)]

    def _last_collectives(self, rank: int) -> str:
        """``; its last collectives: ...`` from the trace file a dead worker left (see
        :mod:`shardlib.mesh.trace`), or ``""``."""
        from .diagnosis import ordinal
        from .trace import format_record, read_trace_file, trace_path

        _, records = read_trace_file(trace_path(self._dir, rank, self._procs[rank].pid) or "")
        if not records:
            return ""
        shown = "; ".join(f"{format_record(r)} (the {ordinal(r['gseq'] + 1)} on {r['group']}, step {r['step'] + 1})"
                          for r in records[-3:])
        return f"; its last collectives, oldest first: {shown}"

    def _difference(self) -> str:
        """The first collective where the workers' trace files differ (all ranks), or ``""``."""
        from .diagnosis import describe_difference
        from .trace import read_trace_file, trace_path

        states = {}
        for rank, proc in enumerate(self._procs):
            _, records = read_trace_file(trace_path(self._dir, rank, proc.pid) or "")
            states[rank] = {"rank": rank, "status": "gone", "records": records or None}
        return "\n".join(describe_difference(states))

    def close(self) -> None:
        """Stop every worker (killing any that does not exit at once) and remove the store."""
        if not getattr(self, "alive", False) and not self._procs:
            return
        self.alive = False
        for conn in self._conns:
            try:
                conn.send(None)
            except Exception:
                pass
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            if not _stopped(proc):  # a stopped process cannot exit: killed at once
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._conns = [], []
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def launch(fn: Callable, nprocs: int, *args: Any, timeout: float = 600.0) -> list:
    """Run ``fn(*args)`` on ``nprocs`` local CPU processes (gloo) and return each rank's result.

    For notebooks and tests; production runs use ``torchrun``. Inside ``fn``,
    ``torch.distributed`` is initialized (world size ``nprocs``), so ``init_mesh`` just builds
    the groups. ``fn`` and ``args`` are sent with cloudpickle: functions defined in a notebook
    cell work.

    Args:
        fn: the per-rank function; its return value must be picklable.
        nprocs: number of processes (world size).
        timeout: seconds each collective may take, and (plus a minute) the whole run.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        WorkerError: a rank raised; every rank is stopped, and the error names the rank and
            carries its message and traceback.
        TypeError: ``fn`` is not callable. ValueError: ``nprocs`` is not an int >= 1, or
            ``timeout`` not a positive number; both before any process starts.

    Example:
        >>> def work():
        ...     import shardlib, torch
        ...     mesh = shardlib.init_mesh({"dp": 2})
        ...     return shardlib.all_reduce(torch.ones(1), "dp").item()
        >>> launch(work, 2)
        [2.0, 2.0]
    """
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable (the function each rank runs), got {type(fn).__name__} {fn!r}")
    with WorkerGroup(nprocs, timeout=timeout) as group:
        return group.run(fn, *args)
