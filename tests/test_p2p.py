"""Pipeline point-to-point programs, checked on a clock without processes (tier 0).

Every schedule, for a range of (p, m, v), training and evaluation, handshake and steady steps:
sends and posted receives pair up in order on every directed pair (NCCL pairs by posting order
and ignores tags), every tensor is waited for before its use, and nothing deadlocks under
NCCL's semantics (one in-order stream per rank for its batches, a receive completes only once
the matching send was posted, a compute waits for the batches it waits on) or gloo's (the host
blocks on each wait). The checker itself is shown to catch the hangs it is there for.
"""

import pytest
import torch

from shardlib.errors import ShardingError
from shardlib.parallel.actions import stage_owners
from shardlib.parallel.p2p import (Message, Post, Read, Run, Wait, action_times, is_local, needed_by, receives_ahead,
                                   sent_by, transfer_program)
from shardlib.parallel.p2p_check import check_programs
from shardlib.parallel.schedules import Action, build_schedule, simulate

CASES = [(name, p, m, v) for p in (2, 3, 4) for m in (1, 2, 3, 4, 5, 8)
         for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1), ("zbv", 2), ("dualpipev", 2)]
         if not (name == "interleaved_1f1b" and m % p) and not (name == "dualpipev" and m < 2 * p)]


def _forwards(schedule):
    return [[a for a in acts if a.kind == "F"] for acts in schedule]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_programs_pair_in_order_and_never_deadlock(name, p, m, v):
    """Under both semantics: pairing in order on every directed pair, no deadlock, and no idle
    time added to the schedule's own clock (transfers take no time here), so the transfers
    hold back no action beyond its data dependencies."""
    full = build_schedule(name, p, m, v)
    for sched in (full, _forwards(full)):
        makespan = simulate(sched, backward_cost=2).makespan if sched is full else None
        for handshake in (False, True):
            programs = [transfer_program(sched, r, handshake) for r in range(p)]
            for semantics in ("nccl", "gloo"):
                check = check_programs(sched, programs, semantics)
                if makespan is not None:
                    assert check.makespan == makespan
            sent = [m for prog in programs for ins in prog if isinstance(ins, Post) for m in ins.sends]
            headers = [m for m in sent if m.header]
            owners = stage_owners(sched)
            # a header before the first activation over each boundary between two ranks, in a handshake only
            # (a V's two stages on one rank hand their tensors over in memory)
            remote = sum(owners[s] != owners[s + 1] for s in range(p * v - 1))
            assert remote == p * v - 1 - (v == 2 and name in ("zbv", "dualpipev"))
            assert len(headers) == (remote if handshake else 0)
            assert len(sent) - len(headers) == sum(sent_by(a, p * v) is not None and not is_local(sent_by(a, p * v), owners)
                                                   for acts in sched for a in acts)
            for r, prog in enumerate(programs):
                for i, ins in enumerate(prog):  # each receive's wait comes just before the action using it
                    if isinstance(ins, Wait) and ins.message is not None:  # (only posts of later receives between)
                        nxt = next(x for x in prog[i + 1:] if not isinstance(x, Post))
                        assert isinstance(nxt, Run) and needed_by(sched[r][nxt.index], p * v) == ins.message
                assert not any(is_local(x, owners) for ins in prog if isinstance(ins, Post) for x in ins.sends + ins.recvs)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_receives_ahead_pairs_on_gloo_and_posts_just_before_the_send(name, p, m, v):
    """gloo's steady programs post each receive ahead of its sender's send on the clock: the same
    pairs in the same order as the rounds, no deadlock and the schedule's own makespan under
    gloo's semantics; every receive posted before the action it feeds, and before the clock time
    its sender's action ends (after the last action of this rank that ends earlier); the
    first stage's first forward comes before any receive is posted (posting every receive at the
    start delayed it)."""
    full = build_schedule(name, p, m, v)
    n = p * v
    for sched in (full, _forwards(full)):
        rounds = [transfer_program(sched, r) for r in range(p)]
        ahead = [receives_ahead(sched, r) for r in range(p)]
        check = check_programs(sched, ahead, "gloo")
        assert check.pairs == check_programs(sched, rounds, "gloo").pairs
        if sched is full:
            assert check.makespan == simulate(sched, backward_cost=2).makespan
        times = action_times(sched, 2)
        owners = stage_owners(sched)
        sent_at = {sent_by(a, n): times[q][k][1] for q in range(p) for k, a in enumerate(sched[q])
                   if sent_by(a, n) is not None}
        for r, prog in enumerate(ahead):
            assert not any(isinstance(ins, Read) for ins in prog)
            reached = [0] + [end for _, end in times[r]]  # the clock at the place before action k
            for i, ins in enumerate(prog):
                if isinstance(ins, Post) and ins.recvs:
                    (msg,) = ins.recvs
                    k = next(x.index for x in prog[i:] if isinstance(x, Run))  # the action it is posted before
                    assert reached[k] < sent_at[msg] or k == 0  # before the send on the clock
                    assert reached[k + 1] >= sent_at[msg]  # and at the latest such place
                    use = next(j for j, a in enumerate(sched[r]) if needed_by(a, n) == msg)
                    assert k <= use
            if 0 in [a.stage for a in sched[r][:1]]:  # the first stage's first forward: no receive before it
                assert isinstance(prog[0], Run)
            for i, ins in enumerate(prog):  # receives are waited for just before the compute that uses them
                if isinstance(ins, Wait) and ins.message is not None:
                    nxt = prog[i + 1]
                    assert isinstance(nxt, Run) and needed_by(sched[r][nxt.index], n) == ins.message
            assert not any(is_local(x, owners) for ins in prog if isinstance(ins, Post) for x in ins.sends + ins.recvs)


def test_receives_ahead_would_deadlock_under_nccl():
    """Why the native path keeps the rounds: under NCCL's in-order batches each 1F1B stage
    posts a receive ahead of a send the other needs first (the first stage microbatch 1's
    gradient before microbatch 2's activation, the last stage that activation before that
    gradient), and each stream holds its send back behind its receive."""
    sched = build_schedule("1f1b", 2, 4, 1)
    with pytest.raises(ShardingError, match="deadlock"):
        check_programs(sched, [receives_ahead(sched, r) for r in range(2)], "nccl")
    check_programs(sched, [transfer_program(sched, r) for r in range(2)], "nccl")


def test_receives_ahead_refuses_one_rank():
    with pytest.raises(ShardingError, match="at least 2 ranks"):
        receives_ahead(build_schedule("1f1b", 1, 4, 1), 0)


def test_gloo_wait_makes_the_whole_batch_ready(monkeypatch):
    """A program waits once per batch (check_programs' model: the wait makes every receive of
    the batch ready); on gloo each operation is a work of its own, so the runner's wait for a
    batch waits for each of its receives (it used to wait for the named one only, and the next
    compute read the other receive's buffer unwaited); its sends wait for the end of the step."""
    from shardlib.parallel import p2p_run

    waited = []

    class Work:
        def __init__(self, name):
            self.name = name

    monkeypatch.setattr(p2p_run, "wait_works", lambda mesh, works, rec, p2p: waited.extend(w.name for w in works))
    transfers = p2p_run.Transfers.__new__(p2p_run.Transfers)
    transfers.mesh = None
    first, second = Message("activation", 0, 0), Message("gradient", 2, 0)
    transfers._batches = {0: p2p_run._Batch([Work("send"), Work("first"), Work("second")], [None, first, second],
                                            [{}, {}, {}])}
    transfers.wait(0, first)
    assert waited == ["first", "second"]
    transfers.wait(0, second)
    assert waited == ["first", "second"]  # nothing left to wait for before its use
    transfers.finish()
    assert waited == ["first", "second", "send"]


def test_p2_pair_carries_activations_and_gradients_in_the_senders_order():
    """p = 2, interleaved: rank 0 -> 1 carries activations of stages 0 and 2 and gradients of
    stage 2, interleaved; the receiver posts them in rank 0's order of production."""
    sched = build_schedule("interleaved_1f1b", 2, 4, 2)
    pairs = check_programs(sched, [transfer_program(sched, r) for r in range(2)]).pairs
    kinds = {(m.kind, m.stage) for m in pairs[(0, 1)]}
    assert kinds == {("activation", 0), ("activation", 2), ("gradient", 2)}
    produced = [sent_by(a, 4) for a in sched[0] if sent_by(a, 4) is not None and sent_by(a, 4).dst_stage % 2 == 1]
    assert list(pairs[(0, 1)]) == produced


def _use_order_program(sched, rank, separate=False):
    """The pre-rounds pattern: sends posted right after their action, receives right before the
    action that uses them, in the receiver's order of use (``separate``: each in its own batch,
    as unbatched isend/irecv; else the receive joins the previous action's sends)."""
    n = 1 + max(a.stage for acts in sched for a in acts)
    prog, nb, pending = [], 0, []
    for k, a in enumerate(sched[rank]):
        y = needed_by(a, n)
        if separate and pending:
            prog.append(Post(nb, tuple(pending), ()))
            nb, pending = nb + 1, []
        if y is not None or pending:
            prog.append(Post(nb, tuple(pending), (y,) if y is not None else ()))
            if y is not None:
                prog.append(Wait(nb, y))
            nb, pending = nb + 1, []
        prog.append(Run(k))
        s = sent_by(a, n)
        pending = [s] if s is not None else []
    if pending:
        prog.append(Post(nb, tuple(pending), ()))
        nb += 1
    waited = {ins.batch for ins in prog if isinstance(ins, Wait)}
    return tuple(prog) + tuple(Wait(b, None) for b in range(nb) if b not in waited)


def test_checker_finds_the_nccl_hang_of_unbatched_1f1b():
    """Unbatched sends and receives in 1F1B: two neighbours send to each other at once and each
    waits for its send to be received before posting the receive; under NCCL's in-order
    semantics that hangs, under gloo's (sends progress on their own) it does not."""
    sched = build_schedule("1f1b", 2, 4)
    programs = [_use_order_program(sched, r, separate=True) for r in range(2)]
    check_programs(sched, programs, "gloo")
    with pytest.raises(ShardingError, match="point-to-point deadlock under nccl semantics"):
        check_programs(sched, programs, "nccl")


def test_checker_finds_a_receive_posted_too_early_on_the_in_order_stream():
    """A receive posted one action ahead of its turn (before the send of the action in between)
    holds back that send on NCCL's in-order stream, which its own sender waits for: a hang
    (GPipe, one microbatch: stage 0's gradient needs stage 1 to have its activation first)."""
    sched = build_schedule("gpipe", 2, 1)
    early = [(Post(0, (), (Message("gradient", 1, 0),)), Run(0), Post(1, (Message("activation", 0, 0),), ()),
              Wait(0, Message("gradient", 1, 0)), Run(1), Wait(1, None)),
             (Post(0, (), (Message("activation", 0, 0),)), Wait(0, Message("activation", 0, 0)), Run(0), Run(1),
              Post(1, (Message("gradient", 1, 0),), ()), Wait(1, None))]
    with pytest.raises(ShardingError, match="deadlock under nccl semantics at t=1: rank 0 at the end, batches not done "
                                            r"\[0, 1\]"):
        check_programs(sched, early, "nccl")
    check_programs(sched, [transfer_program(sched, r) for r in range(2)], "nccl")


def test_order_follows_the_sender_whatever_order_the_receiver_uses():
    """A valid schedule whose last stage uses microbatch 1 before 0: the rounds pair in order;
    receiving in the order of use pairs the wrong tensors (named)."""
    sched = [[Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 1), Action(0, "B", 0)],
             [Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 1), Action(1, "B", 0)]]
    simulate(sched)  # a valid schedule
    for semantics in ("nccl", "gloo"):
        check_programs(sched, [transfer_program(sched, r) for r in range(2)], semantics)
    with pytest.raises(ShardingError, match=r"order differs on ranks 0 -> 1: message 0 is activation 0->1 mb0 on the "
                                            r"sender and activation 0->1 mb1 on the receiver"):
        check_programs(sched, [_use_order_program(sched, r) for r in range(2)])


def test_handshake_reads_each_header_before_posting_its_activation():
    sched = build_schedule("1f1b", 3, 4)
    prog = transfer_program(sched, 1, handshake=True)
    reads = [i for i, ins in enumerate(prog) if isinstance(ins, Read)]
    assert len(reads) == 1 and prog[reads[0]].message == Message("activation", 0, 0, header=True)
    post = next(ins for ins in prog[reads[0]:] if isinstance(ins, Post))
    assert post.recvs == (Message("activation", 0, 0),)  # the activation's receive, right after its header


def test_bad_programs_and_arguments_are_named():
    sched = build_schedule("gpipe", 2, 1)
    good = [transfer_program(sched, r) for r in range(2)]
    no_wait = [tuple(i for i in good[0]), tuple(i for i in good[1] if not (isinstance(i, Wait) and i.message))]
    with pytest.raises(ShardingError, match=r"rank 1 runs 1F0 before waiting for activation 0->1 mb0"):
        check_programs(sched, no_wait)
    never = [good[0], tuple(i for i in good[1] if not (isinstance(i, Wait) and i.message is None))]
    with pytest.raises(ShardingError, match="rank 1 posts batches it never waits for"):
        check_programs(sched, never)
    with pytest.raises(ShardingError, match="semantics must be 'nccl' or 'gloo', got 'mpi'"):
        check_programs(sched, good, "mpi")
    with pytest.raises(ShardingError, match="a pipeline has at least 2 ranks, got a schedule of 1"):
        transfer_program(build_schedule("gpipe", 1, 2), 0)
    with pytest.raises(ShardingError, match=r"pipeline schedule deadlocks: rank 0 waits at 0B0, rank 1 waits at 1F0"):
        action_times([[Action(0, "B", 0), Action(0, "F", 0)], [Action(1, "F", 0), Action(1, "B", 0)]])


def test_header_limits_are_named():
    from shardlib.parallel.p2p_run import _dtype_id, _header

    with pytest.raises(ShardingError, match="a stage output of dtype torch.complex64 cannot be sent"):
        _dtype_id(torch.complex64)
    with pytest.raises(ShardingError, match=r"tensors of up to 8 dimensions; a stage output of shape \(1, 1, 1, 1, 1, "
                                            r"1, 1, 1, 1\) cannot be sent"):
        _header(torch.zeros([1] * 9), torch.device("cpu"))
