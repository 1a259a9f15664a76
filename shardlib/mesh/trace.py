"""The collective trace: every rank records each collective it issues, always on.

A record holds what pairs the collectives of a group across ranks: the kind, the group (mesh
axes, channel and ranks) and the index of the call on that group, the local shape and dtype, a
note from the strategy (``chunk 3``), the library call site (``zero.py:140``), the user's frame
that led to it (``train.py:88 in step``), this rank's optimizer step and the wall time.

Records live in a ring of :data:`SLOTS` fixed-size slots in a memory-mapped file (one per rank,
in ``SHARDLIB_TRACE_DIR`` or a per-user temporary folder). A peer on the same host, or the
launcher, can read the last collectives of a rank whose process ended (a native abort, SIGKILL),
which is what names a mismatch after gloo aborted the process. The file is removed at a normal
exit. This is the idea of PyTorch's NCCL flight recorder, kept on every backend and read while
the job still runs (:mod:`shardlib.mesh.watchdog`).

Cost: one stack walk to the first frame outside shardlib and torch, a short string and a copy
into the ring, a few microseconds per collective (``benchmarks/trace_overhead.py``).
"""

from __future__ import annotations

import atexit
import mmap
import os
import socket
import sys
import tempfile
import time

from .checks import env_count, env_flag

__all__ = ["Trace", "SLOTS", "read_trace_file", "trace_path", "format_record", "signature", "is_library", "main"]

SLOTS = 512
_SLOT = 256
_HEADER = 256
_MAGIC = b"SHARDLIB-TRACE-1"
_SEP = "\x1f"
_FIELDS = ("seq", "group", "gseq", "kind", "shape", "dtype", "note", "site", "caller", "step", "t")

_MESH_DIR = os.path.dirname(os.path.abspath(__file__))
_PKG_DIR = os.path.dirname(_MESH_DIR)
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))


def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__))


def is_library(filename: str) -> bool:
    """True for frames of shardlib, torch, the standard library and installed packages: not the
    user's code."""
    return (filename.startswith(_PKG_DIR) or filename.startswith(_TORCH_DIR[0] or "\0") or filename.startswith(_STDLIB_DIR)
            or filename.startswith("<frozen") or "site-packages" in filename)


_TORCH_DIR = [""]


_STALE_S = 7 * 24 * 3600  # trace files a crash left behind are removed after a week


def _trace_dir() -> str | None:
    """The folder of the ring files: ``SHARDLIB_TRACE_DIR``, else ``<tmp>/shardlib-trace-<uid>``
    (mode 0700). None if it is not a folder this user owns (another user could plant links)."""
    d = os.environ.get("SHARDLIB_TRACE_DIR")
    if not d:
        d = os.path.join(tempfile.gettempdir(), f"shardlib-trace-{os.getuid() if hasattr(os, 'getuid') else 0}")
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        st = os.lstat(d)
    except OSError:
        return None
    import stat

    if not stat.S_ISDIR(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
        return None
    _remove_stale(d)
    return d


def _remove_stale(d: str) -> None:
    """Remove ring files (ours: the name and the magic) older than a week that crashed runs left."""
    now = time.time()
    try:
        names = [n for n in os.listdir(d) if n.startswith("rank") and n.endswith(".trace")]
    except OSError:
        return
    for name in names:
        path = os.path.join(d, name)
        try:
            if now - os.lstat(path).st_mtime < _STALE_S or os.path.islink(path):
                continue
            with open(path, "rb") as f:
                if f.read(len(_MAGIC)) != _MAGIC:
                    continue
            os.unlink(path)
        except OSError:
            pass


def trace_path(folder: str, rank: int, pid: int) -> str | None:
    """The ring file of ``rank`` (process ``pid``) in ``folder``, or None."""
    import glob

    found = glob.glob(os.path.join(glob.escape(folder), f"rank{rank}-{pid}-*.trace"))
    return found[0] if found else None


def signature(rec: dict, sites: bool = False) -> tuple:
    """What must agree across the ranks of a group for their ``gseq``-th collective to pair:
    kind, shape, dtype and the strategy's note; with ``sites``, also the call sites (which may
    differ in a correct program: the same collective reached from two branches)."""
    key = (rec["kind"], rec["shape"], rec["dtype"], rec["note"])
    return key + (rec["site"], rec["caller"]) if sites else key


def format_record(rec: dict, with_group: bool = True) -> str:
    """``all_gather(axis 'dp', (512,) float32, chunk 3) at zero.py:140 from train.py:88 in step``."""
    axis = rec["group"].split("[")[0]
    parts = [f"axis {axis!r}"] if with_group else []
    if rec["shape"]:
        parts.append(f"{rec['shape']} {rec['dtype']}".strip())
    if rec["note"]:
        parts.append(rec["note"])
    text = f"{rec['kind']}({', '.join(parts)})"
    if rec["site"]:
        text += f" at {rec['site']}"
    if rec["caller"] and not rec["caller"].startswith(rec["site"] + " "):
        text += f" from {rec['caller']}"
    return text


def _decode(raw: bytes) -> dict | None:
    n = int.from_bytes(raw[:2], "little")
    if not 0 < n <= _SLOT - 2:
        return None
    fields = raw[2 : 2 + n].decode("utf-8", "replace").split(_SEP)
    if len(fields) != len(_FIELDS):
        return None
    rec = dict(zip(_FIELDS, fields))
    try:
        rec["seq"], rec["gseq"], rec["step"], rec["t"] = int(rec["seq"]), int(rec["gseq"]), int(rec["step"]), float(rec["t"])
    except ValueError:
        return None
    return rec


def _read_header(buf) -> dict:
    raw = bytes(buf[:_HEADER])
    if not raw.startswith(_MAGIC):
        return {}
    text = raw[len(_MAGIC) : len(_MAGIC) + int.from_bytes(raw[-2:], "little")].decode("utf-8", "replace")
    out = {}
    for item in text.split(_SEP):
        key, _, value = item.partition("=")
        out[key] = value
    return out


def _records(buf) -> list[dict]:
    recs = []
    for i in range(SLOTS):
        off = _HEADER + i * _SLOT
        rec = _decode(bytes(buf[off : off + _SLOT]))
        if rec is not None:
            recs.append(rec)
    recs.sort(key=lambda r: r["seq"])
    return recs


def read_trace_file(path: str) -> tuple[dict, list[dict]]:
    """``(header, records oldest first)`` of a rank's trace file (also of an ended process).

    The header has ``rank``, ``pid``, ``host``, ``status`` (``running``, ``returned``,
    ``exited``) and ``step``. Returns ``({}, [])`` if the file is missing or not a trace.
    """
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return {}, []
    if len(data) < _HEADER + SLOTS * _SLOT:
        return {}, []
    return _read_header(data), _records(data)


class Trace:
    """The collective trace of this process (one per process: every mesh records into it).

    Args:
        rank: this process's global rank.
        path: the ring file, created (refused if it exists); ``None`` makes
            ``<trace dir>/rank<rank>-<pid>-<random>.trace``; ``""`` keeps the ring in anonymous
            memory (nothing survives the process).

    Attributes:
        step: optimizer steps finished on this rank (:meth:`next_step`).
        status: ``running``, ``returned`` (a launched function returned) or ``exited``.
        waiting: ``(record, monotonic start)`` of the collective the main thread is blocked in.
        check: check mode (``SHARDLIB_CHECK_COLLECTIVES=1``; on in the tests): the local checks
            (every tensor handed to ``torch.distributed`` on the mesh's device and contiguous) on
            every step, and the comparisons across ranks while :attr:`compare` is True.
        compare_steps: ``SHARDLIB_CHECK_STEPS``: check mode compares across ranks during the
            first this many optimizer steps of a task only (None, unset: every step).
    """

    def __init__(self, rank: int, path: str | None = None):
        self.rank, self.pid, self.host = rank, os.getpid(), socket.gethostname()
        self.seq, self.step, self.status = 0, 0, "running"
        self.waiting = None
        self.check = env_flag("SHARDLIB_CHECK_COLLECTIVES")
        self.compare_steps = env_count("SHARDLIB_CHECK_STEPS")
        self._gseq: dict[str, int] = {}
        self._labels: dict = {}
        self._sites: dict = {}
        self._kinds: dict = {}  # code object -> 0 library, 1 shardlib.mesh, 2 shardlib, 3 the user's
        self._names: dict = {}
        self._torch = _TORCH_DIR[0] = _torch_dir()
        size = _HEADER + SLOTS * _SLOT
        self.path = None
        fd = None
        try:
            if path is None:  # a new file of a unique name (O_EXCL: never through a planted link)
                d = _trace_dir()
                if d is not None:
                    fd, path = tempfile.mkstemp(prefix=f"rank{rank}-{self.pid}-", suffix=".trace", dir=d)
            elif path:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError:
            fd = None
        if fd is not None:
            try:
                os.ftruncate(fd, size)
                self._buf = mmap.mmap(fd, size)
                self.path = path
            except OSError:
                self._buf = mmap.mmap(-1, size)
            finally:
                os.close(fd)
        else:
            self._buf = mmap.mmap(-1, size)
        self._write_header()
        atexit.register(self._at_exit)

    # -- recording --------------------------------------------------------------------------------
    def label(self, mesh, names: tuple[str, ...], channel: int) -> str:
        """``dp[0,1]`` / ``dp#1[0,1]``: the group's axes, channel and global ranks."""
        key = (id(mesh), names, channel)
        label = self._labels.get(key)
        if label is None:
            ranks = ",".join(map(str, mesh.axis_ranks(names)))
            label = "+".join(names) + (f"#{channel}" if channel else "") + f"[{ranks}]"
            self._labels[key] = label
        return label

    def record(self, kind: str, label: str, shape, dtype, note: str = "") -> dict:
        """Append one collective; returns its record (a dict of the fields of :func:`format_record`)."""
        site, caller = self._call_sites()
        key = label if kind not in ("send", "recv") else label + ">p2p"  # collectives pair by their count on the group
        gseq = self._gseq.get(key, 0)
        self._gseq[key] = gseq + 1
        names = self._names.get((shape, dtype))
        if names is None:
            names = self._names[(shape, dtype)] = (str(tuple(shape)), str(dtype).replace("torch.", ""))
        seq, t = self.seq, time.time()
        rec = {"seq": seq, "group": label, "gseq": gseq, "kind": kind, "shape": names[0], "dtype": names[1],
               "note": note, "site": site, "caller": caller, "step": self.step, "t": t}
        text = (f"{seq}\x1f{label}\x1f{gseq}\x1f{kind}\x1f{names[0]}\x1f{names[1]}\x1f{note}\x1f{site}\x1f{caller}"
                f"\x1f{self.step}\x1f{t}").encode()[: _SLOT - 2]
        off = _HEADER + (seq % SLOTS) * _SLOT
        self._buf[off : off + 2 + len(text)] = len(text).to_bytes(2, "little") + text
        self.seq = seq + 1
        return rec

    def _call_sites(self) -> tuple[str, str]:
        f = sys._getframe(2)  # the caller of record()
        site = caller = ""
        depth = 0
        cache = self._sites
        while f is not None and depth < 80:
            code = f.f_code
            try:
                kind = self._kinds.get(code)
                cacheable = True
            except TypeError:  # code torch.compile generated can hold a dict among its constants: unhashable
                kind, cacheable = None, False
            if kind is None:
                fn = code.co_filename
                lib = (fn.startswith(self._torch) or fn.startswith(_STDLIB_DIR) or fn.startswith("<frozen")
                       or "site-packages" in fn) and not fn.startswith(_PKG_DIR)
                kind = 0 if lib else 1 if fn.startswith(_MESH_DIR) else 2 if fn.startswith(_PKG_DIR) else 3
                if cacheable:
                    self._kinds[code] = kind
            if not cacheable:
                f, depth = f.f_back, depth + 1  # nor can its call site be cached by code: it is compiled code
                continue
            if kind >= 2 and not site:
                site = cache.get((code, f.f_lasti, False)) or self._site(f, False)
            if kind == 3:
                caller = cache.get((code, f.f_lasti, True)) or self._site(f, True)
                break
            f = f.f_back
            depth += 1
        return site, caller

    def _site(self, f, with_func: bool) -> str:
        text = f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"
        if with_func:
            text += f" in {f.f_code.co_name}"
        if len(self._sites) < 100_000:
            self._sites[(f.f_code, f.f_lasti, with_func)] = text
        return text

    def new_task(self) -> None:
        """Count every group's collectives from 0 again: a new function of ``launch`` starts on
        every rank at once (an earlier one may have ended on different ranks at different points)."""
        self._gseq.clear()
        self.step = 0
        self._buf[_HEADER:] = bytes(SLOTS * _SLOT)  # the earlier task's records would pair with this one's
        self._write_header()

    @property
    def compare(self) -> bool:
        """Check mode compares across ranks now: each collective's kind, shape and dtype before it
        runs, and a pipeline step's input signature (a sharded module's local batch is compared
        on every step: a guard on the step would make torch.compile recompile that check). True
        in check mode during the first :attr:`compare_steps` optimizer steps (all of them when it
        is None). The ranks of a group decide alike as long as they are at the same step; a rank
        a step ahead is found by the watchdog's comparison of the traces instead
        (``SHARDLIB_WATCHDOG``)."""
        return self.check and (self.compare_steps is None or self.step < self.compare_steps)

    def next_step(self) -> None:
        """An optimizer step finished on this rank."""
        self.step += 1
        self._write_header()

    def set_status(self, status: str) -> None:
        self.status = status
        self._write_header()

    # -- reading ------------------------------------------------------------------------------------
    def records(self, last: int = SLOTS) -> list[dict]:
        """This rank's last ``last`` records, oldest first."""
        return _records(self._buf)[-last:]

    def _write_header(self) -> None:
        text = _SEP.join(f"{k}={v}" for k, v in (("rank", self.rank), ("pid", self.pid), ("host", self.host),
                                                   ("status", self.status), ("step", self.step))).encode()
        raw = _MAGIC + text[: _HEADER - len(_MAGIC) - 2]
        raw = raw + b"\0" * (_HEADER - 2 - len(raw)) + len(text[: _HEADER - len(_MAGIC) - 2]).to_bytes(2, "little")
        self._buf[:_HEADER] = raw

    def _at_exit(self) -> None:
        self.set_status("exited")
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass


def main(argv=None) -> int:
    """``python -m shardlib.mesh.trace FILE...``: print the last collectives of each rank's ring
    file (those a crashed or killed run left in ``<tmp>/shardlib-trace-<uid>/``) and the first
    collective where the ranks differ."""
    import argparse

    from .diagnosis import describe_difference

    p = argparse.ArgumentParser(prog="python -m shardlib.mesh.trace", description=main.__doc__)
    p.add_argument("files", nargs="+", help="ring files, one per rank (rank<R>-<pid>-*.trace)")
    p.add_argument("--last", type=int, default=5, help="records shown per rank (default 5)")
    args = p.parse_args(argv)
    states = {}
    for path in args.files:
        header, records = read_trace_file(path)
        if not header:
            print(f"{path}: not a shardlib trace file")
            continue
        rank = int(header.get("rank", -1))
        states[rank] = {"rank": rank, "status": "gone", "records": records}
        print(f"rank {rank} (host {header.get('host')}, pid {header.get('pid')}, {header.get('status')}, "
              f"{header.get('step')} optimizer steps), last collectives, oldest first:")
        for rec in records[-args.last:]:
            print(f"  {format_record(rec)} (#{rec['gseq'] + 1} on {rec['group']}, step {rec['step'] + 1})")
    for line in describe_difference(states):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
