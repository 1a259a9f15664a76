"""Pipeline transfers on real processes: what the runner posts is the checked program.

Every transfer call of a step is recorded and compared with this rank's
:func:`~shardlib.parallel.p2p.transfer_program` (the program :mod:`tests.test_p2p` proves
pairs in order and cannot deadlock): on the native path one ``batch_isend_irecv`` per round, on
gloo's default path each operation one by one (a steady step's receives posted ahead of their
sends, :func:`~shardlib.parallel.p2p.receives_ahead`); the same operations in the same order,
headers only in the first step of an input shape, buffers sized from the cache afterwards. On
the native path (``mesh.native``, forced on gloo) every tag is 0 and each call returns one work
for the whole batch, as NCCL's coalescing does (emulated by :func:`nccl_like_p2p`).
"""

import contextlib

import pytest
import torch

import shardlib
from shardlib.errors import WorkerError
from shardlib.models import GPT, GPTConfig
from shardlib.testing import run_on

pytestmark = pytest.mark.multiprocess


class _Coalesced:
    """One work for a whole batch (what ``batch_isend_irecv`` returns on NCCL)."""

    def __init__(self, works):
        self.works = works

    def wait(self, timeout=None):
        for w in self.works:
            w.wait() if timeout is None else w.wait(timeout)
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self.works)


@contextlib.contextmanager
def nccl_like_p2p(mesh, record=None):
    """Inside: ``mesh.native = True`` (tag 0, pairing by order only) and ``batch_isend_irecv``
    returning one work per batch, as NCCL's coalescing manager does; ``record``: a list that gets
    ``[(op, peer, shape, dtype, tag), ...]`` per call. Undone on exit (the pool reuses processes)."""
    import torch.distributed as dist

    native, batch = mesh.native, dist.batch_isend_irecv

    def coalesced(ops):
        if record is not None:
            record.append([(op.op.__name__, op.peer, tuple(op.tensor.shape), str(op.tensor.dtype), op.tag) for op in ops])
        return [_Coalesced(batch(ops))]

    mesh.native, dist.batch_isend_irecv = True, coalesced
    try:
        yield
    finally:
        mesh.native, dist.batch_isend_irecv = native, batch


@contextlib.contextmanager
def recorded_p2p(record):
    """gloo's default path: each ``isend`` / ``irecv`` appended to ``record`` as a one-operation
    call (as :func:`nccl_like_p2p` records a batch), peers as global ranks, gloo's works."""
    import torch.distributed as dist

    isend, irecv = dist.isend, dist.irecv

    def wrap(fn, name, key):
        def recording(tensor, *args, group=None, tag=0, **kwargs):
            peer = dist.get_global_rank(group, kwargs[key]) if key in kwargs else args[0]
            record.append([(name, peer, tuple(tensor.shape), str(tensor.dtype), tag)])
            return fn(tensor, *args, group=group, tag=tag, **kwargs)
        return recording

    dist.isend, dist.irecv = wrap(isend, "isend", "group_dst"), wrap(irecv, "irecv", "group_src")
    try:
        yield
    finally:
        dist.isend, dist.irecv = isend, irecv


def _config():
    return GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=16, bias=False)


def ce(logits, y):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _expected(runner, handshake, seq):
    """The calls this rank's program makes: per Post, its sends then its receives."""
    from shardlib.parallel.p2p import Post

    _, program = runner.program(True, handshake)
    out = []
    for ins in program:
        if isinstance(ins, Post):
            ops = [("isend", runner.ranks[runner.owners[m.dst_stage]], m) for m in ins.sends]
            ops += [("irecv", runner.ranks[runner.owners[m.stage]], m) for m in ins.recvs]
            out.append([(op, peer, (10,) if m.header else (2, seq, 16), "torch.int64" if m.header else "torch.float32")
                        for op, peer, m in ops])
    return out


def _transfers_worker(native: bool, seqs: list, schedule: str):
    mesh = shardlib.init_mesh({"pp": 2})
    torch.manual_seed(0)
    ref = GPT(_config())
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(_config()), mesh, microbatches=2, schedule=schedule)
    g = torch.Generator().manual_seed(1)
    steps, record, seen = [], [], set()
    with nccl_like_p2p(mesh, record) if native else recorded_p2p(record):
        for seq in seqs:
            x = torch.randint(0, 37, (4, seq + 1), generator=g)
            handshake = seq not in seen  # the first step of a shape
            seen.add(seq)
            record.clear()
            traced = mesh.trace.seq
            losses, _ = smodel.forward_backward(x[:, :-1], criterion=ce, labels=(x[:, 1:],))
            p2p = [r for r in mesh.trace.records(mesh.trace.seq - traced) if r["kind"] in ("send", "recv")]
            with torch.no_grad():
                ref_loss = ref(x[:, :-1], x[:, 1:])[1].item()
            steps.append({"calls": [[c[:4] for c in call] for call in record], "tags": {c[4] for call in record for c in call},
                          "expected": _expected(smodel.runner, handshake, seq), "handshake": handshake,
                          "traced": len(p2p), "loss": None if losses is None else torch.stack(losses).mean().item(),
                          "ref": ref_loss, "last": smodel.runner.last_rank == mesh.index("pp")})
    return steps


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
@pytest.mark.parametrize("native", [False, True])
def test_runner_posts_its_checked_program_and_shapes_once_per_input_shape(native, schedule):
    """Sequence lengths 8, 8, 6, 8: headers in the first step of each new shape only (step 2
    re-handshakes, step 3 finds 8 cached); every step's calls are its program's Posts, every
    traced transfer goes through them; losses equal the unsharded model's on every batch. ZB-V
    (stages 0 and 3 on rank 0, 1 and 2 on rank 1): two boundaries cross ranks, one header each
    way per rank; the 1 -> 2 boundary is handed over in memory."""
    seqs = [8, 8, 6, 8]
    results = run_on(2, _transfers_worker, native, seqs, schedule)
    for rank, steps in enumerate(results):
        assert [s["handshake"] for s in steps] == [True, False, True, False]
        for i, s in enumerate(steps):
            if native:  # one batch_isend_irecv per Post: same operations, peers, shapes, dtypes, in the same order
                assert s["calls"] == s["expected"]
            else:  # gloo: every Post's operations one by one, in the program's order
                assert s["calls"] == [[op] for call in s["expected"] for op in call]
                ops = [call[0][0] for call in s["calls"]]
                if not s["handshake"] and rank == 0 and schedule == "1f1b":  # (p2p.receives_ahead)
                    assert ops[0] == "isend"  # the first stage's first forward is not held back by receives
            assert s["traced"] == sum(len(c) for c in s["calls"])  # no transfer outside a batch
            headers = sum(op[2] == (10,) for call in s["calls"] for op in call)
            # 1F1B: one boundary, one header from stage 0; ZB-V: 0 -> 1 and 2 -> 3
            assert headers == ((1 if schedule == "1f1b" else 2) if s["handshake"] else 0)
            if native:
                assert s["tags"] == {0}
            else:  # gloo's default path: the schedule's number and kind (training: odd)
                assert s["tags"] == {(i + 1) * 2 + 1}
            assert s["last"] == (rank == (1 if schedule == "1f1b" else 0))
            if s["last"]:
                # fp32, the mean of 2 microbatches' cross-entropies against one 4-row forward:
                # measured 0 or 2.4e-7 (one ulp at ~3.6) over 8 batches; 1e-6 leaves room
                assert s["loss"] == pytest.approx(s["ref"], abs=1e-6)


def _mismatched_batches():
    mesh = shardlib.init_mesh({"pp": 2})
    torch.manual_seed(0)
    smodel = shardlib.shard(GPT(_config()), mesh, microbatches=2)
    seq = 8 if mesh.rank == 0 else 6  # the last stage is given another batch
    x = torch.randint(0, 37, (4, seq + 1))
    smodel.forward_backward(x[:, :-1], criterion=ce, labels=(x[:, 1:],))


def test_stages_given_batches_of_other_shapes_are_refused_on_every_rank():
    """Check mode compares the step's input signature over pp before any transfer: the stages
    would size their buffers differently."""
    with pytest.raises(WorkerError) as err:
        run_on(2, _mismatched_batches)
    assert set(err.value.errors) == {0, 1}
    for kind, message in err.value.errors.values():
        assert kind == "ShardingError"
        assert ("run different steps: pp rank 0: forward_backward of a local batch of shape (4, 8) int64, first step "
                "of that shape; pp rank 1: forward_backward of a local batch of shape (4, 6) int64") in message
