"""The ranks' processes as the watchdog sees them: where each registered (host, pid, PID
namespace, trace file), whether it has exited, and what this host's ``/proc`` says of it.

A rank is judged from ``/proc`` only when it runs in this process's PID namespace on this host
(containers on one host may share a host name, not their process ids); every other rank is
known only by what it wrote to the store. Used by :mod:`shardlib.mesh.watchdog` (the diagnosis of
a rank that does not answer) and :mod:`shardlib.mesh.launch` (a stopped worker can neither report
nor exit).
"""

from __future__ import annotations

import json
import os

from .trace import read_trace_file

__all__ = ["Peers", "pid_namespace", "proc_status"]

_RANK = "shardlib/rank"  # f"{_RANK}/{rank}": its registration; f"{_RANK}/{rank}/exit": its last step and records


def pid_namespace() -> str | None:
    """This process's PID namespace (``pid:[4026531836]``), or None where ``/proc`` does not say."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def proc_status(pid: int) -> str:
    """A process of this PID namespace as the diagnosis names it, from ``/proc/<pid>/stat``:
    "stopped" (SIGSTOP, a debugger), "gone" (ended, a zombie, or no ``/proc`` entry) or "silent"
    (alive)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
    except IndexError:  # not the stat format: say nothing of it
        return "silent"
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(st, "silent")


class Peers:
    """Every rank's registration in the store, this rank's made at construction.

    Args:
        store: the ``torch.distributed`` store every rank shares.
        rank: this rank.
        host: this host's name.
        trace_path: this rank's trace file ("" when it has none).
    """

    def __init__(self, store, rank: int, host: str, trace_path: str):
        self.store, self.rank, self.host = store, rank, host
        self.pidns = pid_namespace()
        self._info: dict[int, dict] = {}  # rank -> its registration, once read
        store.set(f"{_RANK}/{rank}", json.dumps({"host": host, "pid": os.getpid(), "pidns": self.pidns,
                                                 "trace": trace_path}))

    def info(self, rank: int) -> dict:
        """``{"host", "pid", "pidns", "trace"}`` of ``rank`` as it registered (cached), or ``{}``
        if it has not (yet)."""
        info = self._info.get(rank)
        if info is None:
            key = f"{_RANK}/{rank}"
            info = json.loads(self.store.get(key)) if self.store.check([key]) else {}
            if info:
                self._info[rank] = info
        return info

    def local(self, info: dict) -> bool:
        """Whether the rank registered as ``info`` is a process this one sees in ``/proc``."""
        return (info.get("host") == self.host and bool(info.get("pid")) and self.pidns is not None
                and info.get("pidns") == self.pidns)

    def exited(self, rank: int) -> bool:
        """Whether ``rank`` exited through Python (it wrote its exit record), or its process is one
        this process sees and has ended: either way it will never answer. False if the store is gone."""
        try:
            if self.store.check([f"{_RANK}/{rank}/exit"]):
                return True
            info = self.info(rank)
        except Exception:  # noqa: BLE001 - the store went away with its host
            return False
        return self.local(info) and proc_status(info["pid"]) == "gone"

    def record_exit(self, step: int, records: list, raised: str | None = None) -> None:
        """This rank's exit record (its last step and collectives, and the uncaught exception it
        exits with, ``"Type: message"``, if any), for the others' diagnosis."""
        self.store.set(f"{_RANK}/{self.rank}/exit", json.dumps({"step": step, "records": records, "raised": raised}))

    def probe(self, rank: int, keep: int) -> dict:
        """The state of a rank that did not answer: from its exit record, else from its pid and
        its last ``keep`` trace records (a process this one sees), else "silent"."""
        info = {}
        try:
            info = self.info(rank)
            key = f"{_RANK}/{rank}/exit"
            if self.store.check([key]):
                done = json.loads(self.store.get(key))
                return {"rank": rank, "host": info.get("host"), "pid": info.get("pid"), "status": "exited",
                        "step": done.get("step", 0), "records": done.get("records"), "raised": done.get("raised")}
        except Exception:  # noqa: BLE001 - the store itself may be gone with its host
            pass
        state = {"rank": rank, "host": info.get("host"), "pid": info.get("pid"), "status": "silent", "step": 0,
                 "records": None}
        if self.local(info):
            state["status"] = proc_status(info["pid"])
            header, records = read_trace_file(info.get("trace") or "")
            if records:
                state["records"] = records[-keep:]
                state["step"] = int(header.get("step", 0) or 0)
        return state
