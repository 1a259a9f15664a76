"""Diagnosis of a stalled or failed collective from every rank's state (a pure function).

Each rank's state (what :meth:`Watchdog.state` publishes, or what a probe of a rank that did
not answer found) has ``rank``, ``host``, ``pid``, ``status``, ``step``, ``waiting`` (the record
it is blocked in), ``waited_s``, ``frame`` (where its main thread is) and ``records`` (its last
collectives, :mod:`shardlib.mesh.trace`). Statuses:

===================  ==================================================================
``waiting``          blocked in a traced collective
``untraced``         blocked in a ``torch.distributed`` call shardlib did not issue
``busy``             running Python code outside any collective (still on its way)
``returned``         the function given to ``launch`` returned; idle
``exited``           its process ended normally
``gone``             its process ended (killed, crashed) or its pair connection closed
``stopped``          its process is stopped (SIGSTOP, a debugger)
``silent``           alive (or on another host) but did not answer
===================  ==================================================================

The collectives of a group pair across its ranks by their index on that group (``gseq``), so
the first index where the ranks' records differ (kind, shape, dtype, note, call sites), or
where one rank has a record the other will never issue, is where they diverged.
"""

from __future__ import annotations

from .trace import format_record, signature

__all__ = ["analyze", "first_difference", "describe_difference", "ordinal", "LOST"]

LOST = ("gone", "stopped", "silent")
_STUCK = ("waiting", "untraced", "returned", "exited") + LOST


def _members(label: str) -> list[int]:
    inner = label[label.index("[") + 1 : label.rindex("]")]
    return [int(x) for x in inner.split(",") if x]


def _axis(label: str) -> str:
    return label.split("[")[0].split("#")[0]


def ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``21st``."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def first_difference(states: dict[int, dict], sites: bool = False):
    """``(time, group label, gseq, {rank: record or None})`` of the earliest divergence, or None.

    ``None`` for a rank means it never reached that index on the group (its records stop
    before); ranks whose records were evicted from their ring before that index are left out.
    ``sites``: call sites count as a difference too (for showing where paths first part, not for
    deciding: a correct program may reach one collective from two lines).
    """
    per: dict[str, dict[int, dict[int, dict]]] = {}
    for r, s in states.items():
        for rec in s.get("records") or ():
            if rec["kind"] in ("send", "recv"):
                continue  # point to point: not a collective of the whole group
            per.setdefault(rec["group"], {}).setdefault(r, {})[rec["gseq"]] = rec
    best = None
    for label, by_rank in per.items():
        known = {r: by_rank.get(r, {}) for r in _members(label)
                 if r in states and states[r].get("records") is not None}
        if len(known) < 2:
            continue
        span = {r: (min(g), max(g)) if g else (0, -1) for r, g in known.items()}
        for gseq in sorted({g for recs in known.values() for g in recs}):
            here = {r: known[r].get(gseq) for r in known if not (known[r] and gseq < span[r][0])}
            if len(here) < 2:
                continue
            if len({signature(x, sites) if x else None for x in here.values()}) > 1:
                t = min(x["t"] for x in here.values() if x)
                if best is None or t < best[0]:
                    best = (t, label, gseq, here)
                break
    return best


def _issued(state: dict, rec: dict) -> bool:
    """Whether the rank of ``state`` issued the collective ``rec`` (its index on the group):
    then a rank waiting in it was only slow to see it complete. Unknown records count as issued,
    unless the rank's process exited: it can never take part again."""
    records = state.get("records")
    if records is None:
        return state["status"] != "exited"
    p2p = rec["kind"] in ("send", "recv")  # point to point is numbered apart from the collectives of its group
    return any(r["group"] == rec["group"] and r["gseq"] >= rec["gseq"] and (r["kind"] in ("send", "recv")) == p2p
               for r in records)


def _waited_for(waiting: list[dict], finished: dict[int, dict]) -> list[int]:
    """The finished ranks in the groups the ``waiting`` ranks wait in."""
    return sorted({m for s in waiting for m in _members(s["waiting"]["group"]) if m in finished})


def _crossed_p2p(states: dict[int, dict]) -> list[str]:
    """Lines for point-to-point waits that can never pair: a rank waits to receive X from a peer
    that waits to send it something else, or to receive from it too."""
    out = []
    for s in states.values():
        rec = s.get("waiting") if s.get("status") == "waiting" else None
        if not rec or rec["kind"] != "recv" or " from rank " not in rec["note"]:
            continue
        what, _, peer = rec["note"].rpartition(" from rank ")
        other = states.get(int(peer)) if peer.isdigit() else None
        theirs = other.get("waiting") if other and other.get("status") == "waiting" else None
        if not theirs or theirs["kind"] not in ("send", "recv") or min(s.get("waited_s", 0), other.get("waited_s", 0)) < 1.5:
            continue  # a wait of a moment is a transfer on its way (1F1B crosses receives for a moment)
        their_what = theirs["note"].rpartition(" to rank " if theirs["kind"] == "send" else " from rank ")[0]
        if theirs["kind"] == "recv" or their_what != what:
            out.append(f"Point to point: rank {s['rank']} waits to receive the {what} from rank {peer} "
                       f"({rec['caller'] or rec['site']}), which waits to {theirs['kind']} the {their_what} "
                       f"({theirs['caller'] or theirs['site']}).")
    return out


def describe_difference(states: dict[int, dict], diff=None) -> list[str]:
    """The lines that show :func:`first_difference` (computed if not given); ``[]`` if none."""
    diff = first_difference(states) if diff is None else diff
    if diff is None:
        return []
    _, label, gseq, recs = diff
    lines = [f"First difference: the {ordinal(gseq + 1)} collective on axis {_axis(label)!r} (group {label}):"]
    for r, rec in sorted(recs.items()):
        if rec is None:
            n = sum(1 for x in states[r].get("records") or () if x["group"] == label and x["kind"] not in ("send", "recv"))
            lines.append(f"  rank {r}: issued none (its last {n} collectives on this group end before it)" if n else
                         f"  rank {r}: issued none (no collective on this group)")
        else:
            lines.append(f"  rank {r}: {format_record(rec)}, in step {rec['step'] + 1}")
    return lines


def _now(s: dict) -> str:
    who = f"rank {s['rank']}"
    if s.get("host") or s.get("pid"):
        who += f" ({s.get('host', '?')}, pid {s.get('pid', '?')})"
    st, step = s["status"], s.get("step", 0)
    if st == "waiting":
        rec = s["waiting"]
        return (f"{who}: waiting {s.get('waited_s', 0):.0f} s in {format_record(rec)} (the {ordinal(rec['gseq'] + 1)} on "
                f"its group {rec['group']}), in step {step + 1}")
    if st == "untraced":
        return f"{who}: blocked in a torch.distributed call shardlib did not issue, at {s.get('frame', '?')}, in step {step + 1}"
    if st == "busy":
        return f"{who}: busy outside any collective at {s.get('frame', '?')}, in step {step + 1}"
    done = f"finished step {step}; " if step else ""
    if st == "returned":
        how = s.get("how", "returned")
        if how.startswith("raised"):
            return f"{who}: {done}its function {how} (its own error is the cause) and it issues no more collectives"
        return f"{who}: {done}its function returned and it issues no more collectives"
    if st == "exited":
        if s.get("raised"):
            return f"{who}: {done}its process exited raising {s['raised']} (its own error is the cause)"
        return f"{who}: {done}its process exited normally"
    last = s.get("records") or []
    tail = f"; its last collective was {format_record(last[-1])} in step {last[-1]['step'] + 1}" if last else ""
    if st == "gone":
        return f"{who}: is gone (its process ended or was killed: a crash, a native abort, SIGKILL, or the host){tail}"
    if st == "stopped":
        return f"{who}: is frozen: its process is stopped (SIGSTOP or a debugger) and did not answer{tail}"
    return f"{who}: did not answer (frozen, hung in native code, or its host is unreachable){tail}"


def analyze(states: dict[int, dict], world: int) -> tuple[bool, str, str]:
    """Decide whether the job is stuck and say why.

    Args:
        states: ``{rank: state}`` for every rank of the world (see the module docstring).
        world: the world size.

    Returns:
        ``(fatal, error class name, message)``. Fatal when a rank is lost (gone, stopped), or
        when no rank is busy and the ranks' collectives differ or a rank stopped issuing them;
        not fatal while a rank is still busy on its way, or when every rank waits in the same
        collective (slow, not stuck).
    """
    ranks = [states[r] for r in sorted(states)]
    lost = [s for s in ranks if s["status"] in LOST]
    hard_lost = [s for s in lost if s["status"] != "silent"]
    # a rank that is alive but did not answer (a long call holding the GIL) may still be on its way
    busy = [s for s in ranks if s["status"] in ("busy", "silent")]
    finished = {s["rank"]: s for s in ranks if s["status"] in ("returned", "exited")}
    done = [s for s in ranks if s["status"] == "waiting" and any(
        not _issued(finished[m], s["waiting"]) for m in _members(s["waiting"]["group"]) if m in finished)]
    diff = first_difference(states)
    crossed = _crossed_p2p(states)
    untraced = not busy and diff is None and any(s["status"] == "untraced" for s in ranks) and any(
        s["status"] == "waiting" for s in ranks)  # one rank in a call of its own, the others in ours
    # stuck: a rank is lost; a rank waits for one that finished; or nobody is on the way and the
    # collectives differ. Not stuck: a rank is still busy, or every rank waits in the same collective.
    fatal = bool(hard_lost) or bool(done) or (not busy and (diff is not None or untraced or bool(crossed)))
    lines = []
    if hard_lost:
        head = ", ".join(f"rank {s['rank']}" for s in hard_lost)
        kind = "is" if len(hard_lost) == 1 else "are"
        lines.append(f"{head} {kind} {'gone or frozen' if len(hard_lost) > 1 else hard_lost[0]['status'].replace('stopped', 'frozen')}: "
                     f"the other ranks wait for {'it' if len(hard_lost) == 1 else 'them'} in their collectives.")
        cls = "RankFailureError"
    elif done and not diff and all(finished[m]["status"] == "exited" for m in _waited_for(done, finished)):
        gone = _waited_for(done, finished)
        waiters = ", ".join(str(s["rank"]) for s in done)
        lines.append(f"rank{'s' * (len(gone) > 1)} {', '.join(map(str, gone))} ended (the process exited) while "
                     f"rank{'s' * (len(done) > 1)} {waiters} wait{'s' * (len(done) == 1)} for "
                     f"{'it' if len(gone) == 1 else 'them'} in a collective that can never complete.")
        cls = "RankFailureError"
    elif not fatal:
        lines.append("a collective waits for a rank that is still on its way (busy outside any collective, or not "
                     "answering); not an error until SHARDLIB_TIMEOUT." if busy else
                     "a collective is taking long: every rank waits in the same one.")
        cls = "CollectiveTimeoutError"
    elif diff is not None or done or untraced or crossed:
        lines.append("the ranks stopped issuing the same collectives (every rank of a group must issue the same "
                     "collectives in the same order).")
        lines.extend(crossed)
        cls = "CollectiveMismatchError"
    else:
        lines.append("a collective is taking long." if not busy else "a collective waits for a rank that is still busy.")
        cls = "CollectiveTimeoutError"
    lines.extend(describe_difference(states, diff))
    if diff is not None:
        parted = first_difference(states, sites=True)
        if parted is not None and parted[0] < diff[0]:
            lines.append("The ranks' paths part earlier, where the call sites of one collective differ:")
            lines.extend(describe_difference(states, parted)[1:])
    lines.append("Now:")
    lines.extend("  " + _now(s) for s in ranks)
    ended = {s["status"] in ("returned", "exited") for s in ranks}
    if len({s.get("step", 0) for s in ranks}) > 1 or len(ended) > 1:
        parts = []
        for s in ranks:
            if s["status"] in ("returned", "exited"):
                parts.append(f"rank {s['rank']} finished step {s['step']}" if s.get("step") else
                             f"rank {s['rank']} ended before its first optimizer step")
            else:
                parts.append(f"rank {s['rank']} is in step {s.get('step', 0) + 1}")
        lines.append("Steps: " + ", ".join(parts) + ".")
    if cls == "CollectiveMismatchError":
        lines.append("Fix: look between the call sites above for a branch on the rank or on this rank's data: uneven "
                     "batches (one rank runs more steps), evaluation or a collective on one rank only, a layer run a "
                     "different number of times.")
    elif cls == "RankFailureError":
        if diff is not None and all(rec is not None for rec in diff[3].values()):  # both issued it, differently
            lines.append("The first difference above is the likely cause: gloo aborts a process whose collective "
                         "receives another size than it expects.")
        lines.append("Fix: read the lost rank's own log (stderr) for why it ended or stopped; restart from the last "
                     "finished checkpoint.")
    return fatal, cls, "\n".join(lines)
