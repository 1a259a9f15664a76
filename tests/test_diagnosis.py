"""The diagnosis of stalled collectives (shardlib.mesh.diagnosis) and the trace ring
(shardlib.mesh.trace), without processes: states are written by hand as the watchdog would
publish them."""

from __future__ import annotations

import os

import pytest

from shardlib.mesh.diagnosis import analyze, first_difference
from shardlib.mesh.trace import SLOTS, Trace, format_record, read_trace_file


def _rec(gseq, kind="all_reduce", group="dp[0,1]", shape="(4,)", site="zero.py:10", caller="train.py:5 in step", step=0,
         t=None, note=""):
    return {"seq": gseq, "group": group, "gseq": gseq, "kind": kind, "shape": shape, "dtype": "float32", "note": note,
            "site": site, "caller": caller, "step": step, "t": float(gseq if t is None else t)}


def _state(rank, status, records, waiting=None, step=0):
    return {"rank": rank, "host": "h", "pid": 100 + rank, "status": status, "step": step, "records": records,
            "waiting": waiting, "waited_s": 31.0, "frame": "train.py:9 in main"}


def test_same_collectives_no_difference():
    recs = [_rec(i) for i in range(3)]
    states = {0: _state(0, "waiting", recs, recs[-1]), 1: _state(1, "waiting", recs, recs[-1])}
    assert first_difference(states) is None
    fatal, cls, text = analyze(states, 2)
    assert not fatal and cls == "CollectiveTimeoutError"  # every rank in the same collective: slow, not stuck


def test_extra_collective_on_one_rank():
    r0 = [_rec(i) for i in range(4)]
    r1 = [_rec(i) for i in range(3)]
    states = {0: _state(0, "waiting", r0, r0[-1]), 1: _state(1, "returned", r1, step=0)}
    _, label, gseq, recs = first_difference(states)
    assert (label, gseq, recs[1]) == ("dp[0,1]", 3, None)
    fatal, cls, text = analyze(states, 2)
    assert fatal and cls == "CollectiveMismatchError"
    assert "the 4th collective on axis 'dp'" in text and "rank 1: issued none" in text
    assert "its function returned" in text


def test_kind_differs_names_both_call_sites():
    r0 = [_rec(0), _rec(1, kind="all_gather", site="gather.py:58", caller="train.py:7 in evaluate")]
    r1 = [_rec(0), _rec(1)]
    states = {0: _state(0, "waiting", r0, r0[-1]), 1: _state(1, "waiting", r1, r1[-1])}
    fatal, cls, text = analyze(states, 2)
    assert fatal and cls == "CollectiveMismatchError"
    assert "rank 0: all_gather(axis 'dp', (4,) float32) at gather.py:58 from train.py:7 in evaluate" in text
    assert "rank 1: all_reduce(axis 'dp', (4,) float32) at zero.py:10 from train.py:5 in step" in text


def test_busy_rank_is_not_a_verdict():
    r0 = [_rec(i) for i in range(4)]
    states = {0: _state(0, "waiting", r0, r0[-1]), 1: _state(1, "busy", r0[:3])}
    fatal, cls, text = analyze(states, 2)
    assert not fatal  # rank 1 may still get there (a long evaluation, a checkpoint on one rank)
    assert "busy outside any collective at train.py:9 in main" in text


def test_stopped_rank_is_named_not_its_neighbour():
    r0 = [_rec(i) for i in range(2)]
    states = {0: _state(0, "waiting", r0, r0[-1]), 1: _state(1, "stopped", None), 2: _state(2, "busy", [])}
    fatal, cls, text = analyze(states, 3)
    assert fatal and cls == "RankFailureError"  # even with a busy rank: a stopped one never answers
    assert text.startswith("rank 1 is frozen") and "rank 0 (h, pid 100): waiting 31 s" in text


def test_gone_rank_last_collective_from_its_trace_file():
    r0 = [_rec(0), _rec(1, shape="(4,)")]
    r1 = [_rec(0), _rec(1, shape="(8,)")]
    states = {0: _state(0, "waiting", r0, r0[-1]), 1: _state(1, "gone", r1)}
    fatal, cls, text = analyze(states, 2)
    assert fatal and cls == "RankFailureError"
    assert "rank 1 is gone" in text and "(8,)" in text and "(4,)" in text


def test_silent_rank_is_not_a_verdict():
    """A rank that is alive but does not answer (a long call holding the GIL: a rank-0-only
    torch.load, a tokenizer) may still get there: named, not fatal (SHARDLIB_TIMEOUT bounds it);
    a stopped one is fatal (see above)."""
    states = {0: _state(0, "waiting", [_rec(0)], _rec(0)), 1: _state(1, "silent", None), 2: _state(2, "busy", [])}
    assert not analyze(states, 3)[0]
    states[2] = _state(2, "waiting", [_rec(0)], _rec(0))
    fatal, cls, text = analyze(states, 3)
    assert not fatal and cls == "CollectiveTimeoutError" and "still on its way" in text and "did not answer" in text


def test_same_collective_from_two_lines_is_not_a_mismatch():
    """Two branches reaching one all_reduce, then every rank in the same slow all_gather: not
    stuck. With a real difference later, the earlier parting of the paths is shown too."""
    r0 = [_rec(0, caller="a.py:25 in main"), _rec(1, kind="all_gather")]
    r1 = [_rec(0, caller="a.py:27 in main"), _rec(1, kind="all_gather")]
    states = {0: _state(0, "waiting", r0, r0[-1]), 1: _state(1, "waiting", r1, r1[-1])}
    assert not analyze(states, 2)[0]
    r1[1] = _rec(1, kind="broadcast")
    fatal, cls, text = analyze(states, 2)
    assert fatal and "First difference: the 2nd collective" in text
    assert "paths part earlier" in text and "a.py:25 in main" in text and "a.py:27 in main" in text


def test_steps_are_compared():
    r0 = [_rec(i, step=i // 2) for i in range(5)]
    states = {0: _state(0, "waiting", r0, r0[-1], step=2), 1: _state(1, "exited", r0[:4], step=2)}
    text = analyze(states, 2)[2]
    assert "Steps: rank 0 is in step 3, rank 1 finished step 2." in text


def test_a_rank_that_exited_raising_is_named_with_its_error():
    """A rank whose uncaught exception ended it (its exit record carries it) was said to have
    "exited normally" while torchrun reported it failed (a new user's pass)."""
    r0 = [_rec(i, step=i // 2) for i in range(5)]
    states = {0: _state(0, "waiting", r0, r0[-1], step=2),
              1: dict(_state(1, "exited", r0[:4], step=2), raised="ValueError: labels of 7 rows")}
    text = analyze(states, 2)[2]
    assert "rank 1 (h, pid 101): finished step 2; its process exited raising ValueError: labels of 7 rows (its own " \
           "error is the cause)" in text, text
    assert "exited normally" in analyze({**states, 1: _state(1, "exited", r0[:4], step=2)}, 2)[2]


def test_evicted_records_are_left_out():
    r0 = [_rec(i) for i in range(100, 110)]
    r1 = [_rec(i) for i in range(0, 105)] + [_rec(105, kind="broadcast")]
    _, _, gseq, recs = first_difference({0: _state(0, "waiting", r0), 1: _state(1, "waiting", r1)})
    assert gseq == 105 and recs[1]["kind"] == "broadcast"


def test_pipeline_point_to_point_is_not_aligned():
    r0 = [_rec(0, kind="send", group="pp[0,1]")]
    r1 = [_rec(0, kind="recv", group="pp[0,1]")]
    assert first_difference({0: _state(0, "waiting", r0), 1: _state(1, "waiting", r1)}) is None


def test_trace_ring_file(tmp_path):
    path = str(tmp_path / "rank3.trace")
    trace = Trace(3, path=path)
    for i in range(SLOTS + 5):
        rec = trace.record("all_gather", "dp[0,1]", (2, i), "torch.float32", note=f"chunk {i}")
    trace.next_step()
    header, records = read_trace_file(path)
    assert header["rank"] == "3" and header["pid"] == str(os.getpid()) and header["step"] == "1"
    assert len(records) == SLOTS and records[-1]["note"] == f"chunk {SLOTS + 4}" and records[0]["seq"] == 5
    assert records[-1]["shape"] == f"(2, {SLOTS + 4})" and records[-1]["dtype"] == "float32"
    assert rec["caller"].startswith("test_diagnosis.py:") and rec["caller"].endswith("in test_trace_ring_file")
    assert format_record(records[-1]).startswith(f"all_gather(axis 'dp', (2, {SLOTS + 4}) float32, chunk {SLOTS + 4})")
    trace._at_exit()
    assert not os.path.exists(path)  # a normal exit removes the file; a crash leaves it for the peers


def test_finished_rank_outside_the_waiting_group_is_not_a_verdict():
    """Ranks 0 and 1 wait in the same slow collective of their group; rank 2 finished, but it is
    not in that group: nothing is stuck yet."""
    rec = _rec(0, group="dp[0,1]")
    states = {0: _state(0, "waiting", [rec], rec), 1: _state(1, "waiting", [rec], rec), 2: _state(2, "returned", [])}
    assert not analyze(states, 3)[0]
    rec3 = _rec(0, group="dp[0,1,2]")  # waiting for a group that holds the finished rank: stuck
    states = {0: _state(0, "waiting", [rec3], rec3), 1: _state(1, "busy", [rec3]), 2: _state(2, "returned", [])}
    fatal, cls, _ = analyze(states, 3)
    assert fatal and cls == "CollectiveMismatchError"


def test_a_rank_that_issued_the_collective_and_finished_is_not_waited_for():
    """Rank 0 took part in the last collective and returned while rank 1 was still seeing it
    complete (the states are gathered over seconds): not stuck."""
    recs = [_rec(0), _rec(1)]
    states = {0: _state(0, "returned", recs), 1: _state(1, "waiting", recs, recs[-1])}
    assert not analyze(states, 2)[0]
    states[0] = _state(0, "returned", recs[:1])  # rank 0 returned without issuing it: stuck
    assert analyze(states, 2)[0]


def test_crossed_point_to_point_waits():
    send = _rec(0, kind="send", group="pp[0,1]", note="activation of stage 0 microbatch 0 of evaluate to rank 1")
    recv = _rec(0, kind="recv", group="pp[0,1]", note="activation of stage 0 microbatch 0 of a training step from rank 0")
    states = {0: _state(0, "waiting", [send], send), 1: _state(1, "waiting", [recv], recv)}
    fatal, cls, text = analyze(states, 2)
    assert fatal and cls == "CollectiveMismatchError" and "Point to point: rank 1 waits to receive" in text
    states[1]["waited_s"] = 0.2  # caught for a moment in a receive that is on its way: not crossed
    assert not analyze(states, 2)[0]
    same = dict(send, note="activation of stage 0 microbatch 0 of a training step to rank 1")
    states = {0: _state(0, "waiting", [same], same), 1: _state(1, "waiting", [recv], recv)}
    assert not analyze(states, 2)[0]  # a big transfer in both waits: slow, not stuck


def test_a_collective_ending_just_after_a_slice_is_not_a_failure(monkeypatch):
    """A sliced wait whose collective completes between the slice's timeout and the check of
    is_completed(): a second wait returns at once, and nothing is diagnosed (it used to be taken
    for a failed collective: a fatal "ranks stopped issuing the same collectives" verdict on a
    loaded machine, every rank waiting 1 s). One that completed with an error still fails."""
    import datetime

    from shardlib.mesh.watchdog import Watchdog

    class Trace:
        waiting = None

    class Work:
        def __init__(self, second_error=None):
            self.calls, self.second_error = 0, second_error

        def wait(self, timeout):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("[gloo] Timed out waiting 1000ms for the collective")
            if self.second_error:
                raise RuntimeError(self.second_error)
            return True

        def is_completed(self):
            return self.calls >= 1

    dog = Watchdog.__new__(Watchdog)
    dog.trace, dog.rank, dog.seconds, dog.verdict, dog.handled = Trace(), 0, 30.0, None, 0
    failed = []
    monkeypatch.setattr(Watchdog, "fail", lambda self, exc: failed.append(str(exc)) or (_ for _ in ()).throw(exc))
    work = Work()
    dog.wait([work], None, datetime.timedelta(seconds=60), p2p=False)
    assert work.calls == 2 and failed == []
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        dog.wait([Work("Connection closed by peer")], None, datetime.timedelta(seconds=60), p2p=False)
    assert failed == ["Connection closed by peer"]


def _dogs(monkeypatch, world, present, answer="1"):
    """Watchdogs of the ranks ``present`` of ``world``, in this process, on one in-memory store:
    their answering threads poll every 0.2 s (not 1 s), a stalled wait is diagnosed after
    0.1 s, a rank that has not answered in ``answer`` s is silent."""
    import torch.distributed as dist

    from shardlib.mesh.trace import Trace as RealTrace
    from shardlib.mesh.watchdog import Watchdog

    from shardlib.mesh import watchdog as wd

    monkeypatch.setattr(wd, "_POLL", 0.2)
    monkeypatch.setenv("SHARDLIB_WATCHDOG", "0.1")
    monkeypatch.setenv("SHARDLIB_WATCHDOG_ANSWER", answer)
    store = dist.HashStore()
    return {r: Watchdog(RealTrace(r, path=""), store, r, world) for r in present}


def _stop(dogs):
    import atexit

    for dog in dogs.values():
        dog._stop.set()
        dog._thread.join(timeout=5)
        atexit.unregister(dog._at_exit)


def _register_ended(store, rank):
    """Register ``rank`` as a process of this host and PID namespace that has ended."""
    import json
    import socket
    import subprocess

    from shardlib.mesh import peers

    ended = subprocess.Popen(["true"])
    ended.wait()
    store.set(f"{peers._RANK}/{rank}", json.dumps({"host": socket.gethostname(), "pid": ended.pid,
                                                     "pidns": peers.pid_namespace(), "trace": ""}))
    return ended.pid


CASES = ["every_rank_reads", "one_rank_gone", "one_rank_never_reads", "one_rank_silent"]


@pytest.mark.parametrize("case", CASES)
def test_a_blocked_rank_ends_once_every_other_rank_holds_the_verdict(monkeypatch, case):
    """A rank whose main thread is blocked in a point-to-point wait diagnoses it on its
    answering thread and publishes a fatal verdict; its process may end (Watchdog.on_fatal) only
    once every rank that can read the verdict holds it (each rank's answering thread
    acknowledges what it reads under a key of its own, in the store): otherwise a peer whose
    wait fails when this process ends diagnoses "rank 0 is gone" instead of raising the verdict
    (1 run in 3 of tests/test_faults.py::test_pipeline_evaluate_on_one_stage_never_pairs_with_training
    with a fixed 1 s grace). It ends as soon as they hold it (it used to wait a fixed 3 s), at
    once when no other rank can read it (one whose process is gone), and after the grace at the
    latest when one never reads it: its answering thread stopped after it answered, or it never
    answered (silent: maybe alive, so waited for; another rank's acknowledgement does not stand
    in for it)."""
    import time

    from shardlib.mesh import watchdog as wd

    world = {"every_rank_reads": 3, "one_rank_gone": 2, "one_rank_never_reads": 3, "one_rank_silent": 3}[case]
    present = {"one_rank_gone": [0], "one_rank_silent": [0, 1]}.get(case, range(world))
    dogs = _dogs(monkeypatch, world, present)
    if case == "one_rank_gone":
        _register_ended(dogs[0].store, 1)
    published, ended = [], []

    def analyze(states, n):  # every answer is in: a verdict
        if case == "one_rank_never_reads":
            dogs[2]._stop.set()  # it answered; now its answering thread is gone
            dogs[2]._thread.join(timeout=5)
        published.append((time.monotonic(), {r: st["status"] for r, st in states.items() if r != 0}))
        return True, "CollectiveMismatchError", "the ranks differ"

    monkeypatch.setattr(wd, "analyze", analyze)
    monkeypatch.setattr(wd, "_GRACE", 1.5)
    try:
        dog0 = dogs[0]

        def on_fatal(cls, text):  # the real one ends the process; record what every peer holds by then
            ended.append((time.monotonic(), cls, text, {r: d.verdict for r, d in dogs.items() if r != 0}))
            dog0._blocked = None

        dog0.on_fatal = on_fatal
        dog0._blocked = (None, time.monotonic())  # the main thread in a point-to-point wait
        limit = time.monotonic() + 15
        while not ended and time.monotonic() < limit:
            time.sleep(0.02)
        assert published and ended, "the blocked rank never ended"
        took, peers, statuses = ended[0][0] - published[0][0], ended[0][3], published[0][1]
        gen = dog0.verdict[0]
        assert ended[0][1:3] == ("CollectiveMismatchError", "the ranks differ") and dog0.verdict[1:] == ended[0][1:3]
        verdict = (gen, "CollectiveMismatchError", "the ranks differ")
        if case == "every_rank_reads":
            assert statuses == {1: "busy", 2: "busy"}
            assert took < 1.0, took  # each peer polls the store every 0.2 s here (_POLL): measured 0.2 s
            assert peers == {1: verdict, 2: verdict}
        elif case == "one_rank_gone":
            assert statuses == {1: "gone"}
            assert took < 0.5, took  # nobody else can read it: no wait (measured 0.0 s)
        elif case == "one_rank_never_reads":
            assert statuses == {1: "busy", 2: "busy"}
            assert took > 1.45, took  # rank 2 never acknowledges: the whole grace (1.5 s here)
            assert peers == {1: verdict, 2: None}
        else:
            assert statuses == {1: "busy", 2: "silent"}
            assert took > 1.45, took  # rank 1's acknowledgement does not count for rank 2
            assert peers == {1: verdict}
    finally:
        _stop(dogs)


def test_a_failed_wait_names_a_rank_whose_process_is_gone_at_once_and_only_once(monkeypatch):
    """A point-to-point wait fails because rank 1's process ended (here: a finished process's
    pid, on this host). The diagnosis does not wait the answer time for a rank whose process is
    gone (it waited SHARDLIB_WATCHDOG_ANSWER / 2 = 5 s here; a ZeRO-3 rank aborted by gloo took
    8-10 s to be named), and a second failed wait of the broken group (the forward's clean-up
    waiting for the same gather) raises the same verdict without asking again (it took another
    5 s). A process of another PID namespace (a container sharing the host name) is never
    judged from this one's /proc."""
    import json
    import time

    from shardlib.errors import RankFailureError
    from shardlib.mesh import peers
    from shardlib.mesh import watchdog as wd

    dogs = _dogs(monkeypatch, 2, [0], answer="10")
    try:
        dog0 = dogs[0]
        pid = _register_ended(dog0.store, 1)
        calls = []
        real = wd.Watchdog.diagnose
        monkeypatch.setattr(wd.Watchdog, "diagnose", lambda self, **kw: calls.append(kw) or real(self, **kw))
        texts = []
        for _ in range(2):
            t0 = time.monotonic()
            with pytest.raises(RankFailureError) as info:
                dog0.fail(RuntimeError("Connection closed by peer"))
            texts.append(str(info.value))
            assert time.monotonic() - t0 < 2.0  # measured 0.0 s
        assert calls == [{"lost": True}]
        assert texts[0] == texts[1] and "rank 1 is gone" in texts[0] and f"pid {pid}" in texts[0], texts[0]
        # the same registration from another PID namespace: its pid means nothing here
        info = dict(json.loads(dog0.store.get(f"{peers._RANK}/1")), pidns="pid:[1]")
        dog0.store.set(f"{peers._RANK}/1", json.dumps(info))
        dog0.peers._info.clear()
        assert dog0.peers.pidns and dog0.peers.pidns != "pid:[1]"
        assert not dog0.peers.exited(1) and dog0.peers.probe(1, 128)["status"] == "silent"
    finally:
        _stop(dogs)


def test_a_verdict_counted_but_never_listed_does_not_hide_the_later_ones(monkeypatch):
    """A publisher interrupted between counting its verdict and listing it (a KeyboardInterrupt,
    which a warm worker now survives) leaves a gap; readers pass it after _UNLISTED_S (0.3 s
    here) and still read every later verdict (they stopped at the gap for good)."""
    import json
    import time

    from shardlib.mesh import verdicts as vd
    from shardlib.mesh import watchdog as wd

    monkeypatch.setattr(vd, "_UNLISTED_S", 0.3)
    dogs = _dogs(monkeypatch, 2, [0, 1])
    try:
        dog0, dog1 = dogs[0], dogs[1]
        _stop({1: dog1})  # rank 1 reads only when this test calls read_verdicts
        store = dog0.store
        store.add(vd._VCOUNT, 1)  # counted, never listed
        dog1.read_verdicts()
        assert dog1.verdict is None
        gen = int(store.add(wd._GEN, 1))
        store.set(f"{vd.DIAG}/{gen}/verdict", json.dumps(["CollectiveMismatchError", "later", [1]]))
        store.set(f"{vd._VLIST}/{int(store.add(vd._VCOUNT, 1))}", str(gen))
        dog1.read_verdicts()
        assert dog1.verdict is None  # still within the wait for the gap
        time.sleep(0.35)
        dog1.read_verdicts()
        assert dog1.verdict == (gen, "CollectiveMismatchError", "later")
        assert store.check([f"{vd.DIAG}/{gen}/ack/1"])
        dog0.verdicts._readers[gen] = [1]
        assert dog0.verdicts.acknowledged(gen)
    finally:
        _stop(dogs)


def test_a_verdict_published_during_a_diagnosis_ends_it(monkeypatch):
    """Two ranks blocked in crossed point-to-point waits diagnose at the same moment. Rank 1's
    verdict comes first, and rank 1 then waits for rank 0's acknowledgement instead of answering
    rank 0's diagnosis. Rank 0 takes that verdict (and acknowledges it) at once, instead of waiting
    for an answer that never comes: it waited until rank 1's process ended and then reported
    "rank 1 is gone" (tests/test_faults.py::test_pipeline_evaluate_on_one_stage_never_pairs_with_training
    failed 5 runs in 6 so, with OMP_NUM_THREADS=1)."""
    import threading
    import time

    dogs = _dogs(monkeypatch, 2, [0, 1], answer="5")
    try:
        dog0, dog1 = dogs[0], dogs[1]
        _stop({1: dog1})  # rank 1 answers no diagnosis from now on
        got = []
        t0 = time.monotonic()
        diagnosis = threading.Thread(target=lambda: got.append(dog0.diagnose(own=False)))
        diagnosis.start()
        time.sleep(0.3)
        gen = int(dog1.store.add("shardlib/diag/gen", 1))
        dog1.verdicts.publish(gen, "CollectiveMismatchError", "crossed waits", [0])
        diagnosis.join(timeout=10)
        took = time.monotonic() - t0
        assert got == [(True, "CollectiveMismatchError", "crossed waits")]
        assert took < 1.5, took  # measured 0.35 s; the answer time is 5 s here
        assert dog0.verdict == (gen, "CollectiveMismatchError", "crossed waits")  # for its main thread to raise
        assert dog1.verdicts.acknowledged(gen)
    finally:
        _stop(dogs)


def test_a_rank_whose_process_exited_without_records_is_waited_for_in_vain():
    """A script caught an error on pipeline rank 0 and exited; rank 1 waited to receive from it,
    and the verdict said "a collective is taking long: every rank waits in the same one" above
    "rank 0: its process exited normally" (new-user pass, 03_gpt_pipeline_seq_longer_than_
    block_size.py): an exit record without records counted as having issued everything."""
    recv = _rec(0, kind="recv", group="pp[0,1]", note="activation of stage 0 microbatch 0 from rank 0")
    states = {0: _state(0, "exited", None), 1: _state(1, "waiting", [recv], recv)}
    fatal, cls, text = analyze(states, 2)
    assert fatal and cls == "RankFailureError", text
    assert text.startswith("rank 0 ended (the process exited) while rank 1 waits for it in a collective that can never "
                           "complete."), text
    assert "every rank waits in the same one" not in text and "its process exited normally" in text
    # as the watchdog sees it: rank 0's exit record holds the pipeline's first exchange (an object
    # gather on the same group, numbered apart from point to point), not the send rank 1 waits for
    gather = _rec(0, kind="all_gather_object", group="pp[0,1]")
    states = {0: _state(0, "exited", [gather]), 1: _state(1, "waiting", [gather, recv], recv)}
    fatal, cls, text = analyze(states, 2)
    assert fatal and cls == "RankFailureError" and text.startswith("rank 0 ended (the process exited)"), text
    send = _rec(0, kind="send", group="pp[0,1]")  # it sent, then exited: rank 1 was only slow to see it
    assert not analyze({0: _state(0, "exited", [gather, send]), 1: states[1]}, 2)[0]


def test_a_failed_wait_whose_store_is_gone_names_that_instead_of_crashing(monkeypatch):
    """Two torchrun nodes, node 0 killed: its agent held the store, and node 1's ranks, whose
    collectives failed, crashed inside the diagnosis with torch's 'DistNetworkError: Broken pipe'
    from store.check (new-user pass). Now they raise RankFailureError saying the store is gone."""
    import torch.distributed as dist

    from shardlib.errors import RankFailureError

    dogs = _dogs(monkeypatch, 2, [1])
    try:
        dog = dogs[1]

        class Gone:  # every call fails as a TCPStore whose host ended does
            def __getattr__(self, name):
                def call(*args, **kwargs):
                    raise dist.DistNetworkError("Broken pipe")
                return call

        dog.store = dog.verdicts.store = dog.peers.store = Gone()
        with pytest.raises(RankFailureError, match=r"(?s)a collective failed on rank 1, and the store the ranks share to "
                                                   r"name each other is unreachable \(DistNetworkError: Broken pipe\)"
                                                   r".*\(the backend said on rank 1: RuntimeError: Connection closed"):
            dog.fail(RuntimeError("Connection closed by peer"))
    finally:
        _stop(dogs)

