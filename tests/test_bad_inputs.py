"""The bad-input catalogue (issue 13, item 7): every bad input refused clearly, everywhere, first.

The cases are data (``tests/bad_inputs_api.py`` for the library, ``tests/bad_inputs_cli.py`` for
the example scripts' flags, :data:`LAUNCH_CASES` below): an id, the bad call, the exception type
and a regex the message must match, naming the parameter, axis and sizes. For each case this
checks

(a) the exception type and (b) the message, with ``pytest.raises(type, match=regex)`` on each rank;
(c) that it is raised on EVERY rank, with the same message: each group of cases is one run on the
    2-rank pool, whose worker runs every case of the group and returns each rank's outcome;
(d) that no collective ran before it: in the worker, torch.distributed's communicating entry
    points (:data:`COLLECTIVES`, group creation included) are wrapped with counters, reset after
    the group's setup (meshes, sharded models, checkpoints) and read when the case raises; the
    shardlib accounting (``mesh.comm``) must not move either. What "before" covers is each case's
    ``before`` (by default the whole bad call). After the group, an all-reduce over the world
    shows the ranks are still in step (nothing half-sent, nobody waiting).

Launch cases run in this process (they would start workers): there "before" means before any
worker process is started (``Process.start`` is replaced by a counter that refuses to start one).

A silently accepted bad input fails its case. Defects outside this change's files are marked
``xfail(strict=True)`` with the reason, so a fix elsewhere shows up as an XPASS to turn on.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest
import torch

from bad_inputs_api import CASES as API_CASES
from bad_inputs_api import ENVS, Case, M
from bad_inputs_cli import CASES as CLI_CASES
from bad_inputs_cli import env_cli
from shardlib.errors import WorkerError
from shardlib.testing import run_on

pytestmark = pytest.mark.multiprocess

POOL_CASES = API_CASES + CLI_CASES
GROUP_ENVS = dict(ENVS, cli=env_cli)
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter", "reduce_scatter_tensor",
    "reduce_scatter_single", "broadcast",
    "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv", "all_to_all",
    "all_to_all_single", "all_gather_object", "broadcast_object_list", "gather", "gather_object", "scatter",
    "scatter_object_list", "reduce", "new_group",
)
GROUP_TIMEOUT_S = 60  # one group takes about a second; a hang shows up as a WorkerError, not a stuck suite


class CountCollectives:
    """Replace torch.distributed's communicating functions by counting wrappers while active.

    The same wrapper goes into ``torch.distributed`` and ``torch.distributed.distributed_c10d``
    (``P2POp`` checks its op against the latter's ``isend``/``irecv``)."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self._saved: list = []

    def reset(self) -> None:
        self.calls = {}

    def __enter__(self) -> "CountCollectives":
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        for name in COLLECTIVES:
            original = getattr(c10d, name, None) or getattr(dist, name, None)
            if original is None:
                continue

            @functools.wraps(original)
            def counted(*args, _name=name, _original=original, **kwargs):
                self.calls[_name] = self.calls.get(_name, 0) + 1
                return _original(*args, **kwargs)

            for module in (dist, c10d):
                if getattr(module, name, None) is original:
                    self._saved.append((module, name, original))
                    setattr(module, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved = []


def _comm_calls(env: dict) -> int:
    """Collectives shardlib recorded on every mesh of the group's environment."""
    from shardlib.mesh import Mesh

    return sum(m.comm.calls() for m in {id(v): v for v in env.values() if isinstance(v, Mesh)}.values())


def _run_case(case: Case, env: dict, counter: CountCollectives) -> dict:
    counter.reset()
    comm = _comm_calls(env)
    try:
        with pytest.raises(case.exc, match=case.match) as info:
            case.call(env)
    except BaseException as failure:  # noqa: BLE001 - DID NOT RAISE, no match, or another type: reported
        return dict(ok=False, type=type(failure).__name__, message=str(failure)[:2000], collectives=dict(counter.calls),
                    comm=_comm_calls(env) - comm)
    return dict(ok=True, type=type(info.value).__name__, message=str(info.value), collectives=dict(counter.calls),
                comm=_comm_calls(env) - comm)


def _run_group(group: str, tmp: str) -> dict:
    """On every rank: build the group's environment, run each of its cases with counted
    collectives, then check the ranks are in step."""
    import torch.distributed as dist

    env = GROUP_ENVS[group](tmp)
    results = {}
    with CountCollectives() as counter:
        for case in POOL_CASES:
            if case.group == group:
                results[case.id] = _run_case(case, env, counter)
    in_step = torch.ones(1)
    dist.all_reduce(in_step)
    return {"cases": results, "in_step": in_step.item()}


@pytest.fixture(scope="module")
def group_outcomes(tmp_path_factory):
    """``group -> [rank 0's results, rank 1's]``, one pool run per group, on first use."""
    cache: dict[str, Any] = {}

    def get(group: str) -> list:
        if group not in cache:
            tmp = str(tmp_path_factory.mktemp(f"bad-{group}"))
            try:
                cache[group] = run_on(2, _run_group, group, tmp, timeout=GROUP_TIMEOUT_S)
            except WorkerError as exc:  # a group that failed or hung fails each of its cases, once
                cache[group] = exc
        if isinstance(cache[group], WorkerError):
            raise cache[group]
        return cache[group]

    return get


def _param(case: Case):
    marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
    return pytest.param(case, id=f"{case.group}/{case.id}", marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in POOL_CASES])
def test_bad_input_is_refused_on_every_rank_before_any_collective(case, group_outcomes):
    ranks = group_outcomes(case.group)
    assert [r["in_step"] for r in ranks] == [2.0, 2.0], "the ranks are out of step after the group"
    outcomes = [r["cases"][case.id] for r in ranks]
    for rank, out in enumerate(outcomes):
        assert out["ok"], (f"rank {rank}: expected {case.exc} matching {case.match!r}; got {out['type']}: "
                           f"{out['message']}")
        counted = {k: v for k, v in out["collectives"].items() if v}
        assert not counted and out["comm"] == 0, (
            f"rank {rank}: communicated before raising ({counted}, {out['comm']} recorded by mesh.comm); "
            f"window: {case.before}")
    assert outcomes[0]["message"] == outcomes[1]["message"], "the ranks raised different messages"


# -- launch / WorkerGroup: in this process, before any worker starts -------------------------------------------


def _launch_cases() -> list[Case]:
    from shardlib.mesh import WorkerGroup, launch

    def fn():
        return 1

    def case(id, call, exc, match, xfail=None):
        return Case("launch", id, call, exc, match, xfail=xfail, before="before any worker process is started")

    out = []
    for n in (0, -1):
        out.append(case(f"WorkerGroup-nprocs-{n}", lambda e, n=n: WorkerGroup(n), ValueError, M("nprocs must be an int >= 1", f"got {n}")))
        out.append(case(f"launch-nprocs-{n}", lambda e, n=n: launch(fn, n), ValueError, M("nprocs must be an int >= 1", f"got {n}")))
    out += [
        case("launch-nprocs-str", lambda e: launch(fn, "2"), ValueError, M("nprocs must be an int >= 1", "'2'")),
        case("launch-nprocs-float", lambda e: launch(fn, 1.5), ValueError, M("nprocs must be an int >= 1", "1.5")),
        case("launch-nprocs-bool", lambda e: launch(fn, True), ValueError, M("nprocs must be an int >= 1", "True")),
        case("launch-fn-not-callable", lambda e: launch(3, 1), TypeError, M("launch: fn must be callable", "int")),
        case("WorkerGroup-timeout-negative", lambda e: WorkerGroup(1, timeout=-1.0), ValueError, M("timeout must be a positive number of seconds", "-1.0")),
    ]
    return out


LAUNCH_CASES = _launch_cases()


class _Started(Exception):
    """Raised instead of starting a worker process."""


@pytest.mark.parametrize("case", [_param(c) for c in LAUNCH_CASES])
def test_bad_launch_is_refused_before_any_worker_starts(case, monkeypatch, tmp_path):
    import multiprocessing.process
    import tempfile

    started = []

    def start(self):
        started.append(self)
        raise _Started("a worker process would have been started")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a store folder made before the failure lands here
    with pytest.raises(case.exc, match=case.match):
        case.call({})
    assert not started, f"a worker process was started before the error; window: {case.before}"


# -- the catalogue itself ---------------------------------------------------------------------------------------


def test_the_catalogue_has_over_a_hundred_distinct_bad_inputs_each_with_a_pattern():
    cases = POOL_CASES + LAUNCH_CASES
    ids = [(c.group, c.id) for c in cases]
    assert len(set(ids)) == len(ids), "case ids must be unique"
    assert len(cases) >= 100
    for c in cases:
        re.compile(c.match)
        assert isinstance(c.exc, type) and issubclass(c.exc, BaseException)
        assert len(c.match) >= 10, f"{c.id}: a pattern that names nothing"
    assert {c.group for c in POOL_CASES} == set(GROUP_ENVS)


# -- near misses: what the checks must still accept (guards against refusing too much) --------------------------


def _near_misses() -> dict:
    import numpy as np

    import shardlib
    from shardlib import P

    mesh = shardlib.init_mesh({"dp": 2})
    r = mesh.rank
    x = torch.arange(3.0) + 10 * r
    out = {
        "all_gather dim=-1": shardlib.all_gather(x, "dp", dim=-1).tolist(),
        "all_gather numpy dim": tuple(shardlib.all_gather(x.reshape(1, 3), "dp", dim=np.int64(0)).shape),
        "reduce_scatter dim=-1": shardlib.reduce_scatter(torch.ones(2, 4), "dp", dim=-1).tolist(),
        "all_to_all negative dims": shardlib.all_to_all(torch.arange(4.0).reshape(2, 2) + 10 * r, "dp", -2, -1).tolist(),
        "ppermute zip perm": shardlib.ppermute(x, "dp", zip([0, 1], [1, 0])).tolist(),
        "distribute even": shardlib.distribute(torch.arange(8).reshape(4, 2), mesh, P("dp")).tolist(),
        "distribute uneven=True": shardlib.distribute(torch.arange(3), mesh, P("dp"), uneven=True).tolist(),
    }
    torch.manual_seed(0)
    smodel = shardlib.shard(torch.nn.Linear(4, 2), mesh, zero_stage=1)
    opt = shardlib.ZeroOptimizer(smodel, torch.optim.SGD, max_grad_norm=float("inf"), lr=0.0)
    smodel(torch.ones(1, 4) * (r + 1)).sum().backward()
    grads = shardlib.full_grads(smodel)
    opt.step()  # inf: measures the norm, clips nothing
    out["inf: norm"] = (opt.last_grad_norm.item(), torch.cat([g.reshape(-1) for g in grads.values()]).norm().item())
    out["inf: unclipped"] = all(torch.equal(grads[k], g) for k, g in shardlib.full_grads(smodel).items())
    shardlib.clip_grad_norm_(smodel, 0.0)  # as torch: a zero bound zeroes the gradients
    out["0: zeroed"] = all(not g.any() for g in shardlib.full_grads(smodel).values())
    p = shardlib.plan(torch.nn.Linear(4, 2), mesh, sequence_parallel=False, broadcast_buffers=np.bool_(True),
                      dropout_seed=np.int64(3), init_seed=-1, fused={})
    out["plan flags"] = (p.sequence_parallel, p.broadcast_buffers, p.dropout_seed, p.init_seed)
    return out


def test_near_misses_are_still_accepted():
    ranks = run_on(2, _near_misses)
    assert ranks[0]["all_gather dim=-1"] == ranks[1]["all_gather dim=-1"] == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]
    assert ranks[0]["all_gather numpy dim"] == (2, 3)
    assert [r["reduce_scatter dim=-1"] for r in ranks] == [[[2.0, 2.0], [2.0, 2.0]]] * 2
    # rank r's row j goes to rank j; what arrives is concatenated along the columns
    assert [r["all_to_all negative dims"] for r in ranks] == [[[0.0, 1.0, 10.0, 11.0]], [[2.0, 3.0, 12.0, 13.0]]]
    assert [r["ppermute zip perm"] for r in ranks] == [[10.0, 11.0, 12.0], [0.0, 1.0, 2.0]]
    assert [r["distribute even"] for r in ranks] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert [r["distribute uneven=True"] for r in ranks] == [[0, 1], [2]]
    for r in ranks:
        measured, expected = r["inf: norm"]
        assert measured == pytest.approx(expected, rel=1e-6)  # fp32, 10 elements: a few ulps apart at most
        assert r["inf: unclipped"] and r["0: zeroed"]
        assert r["plan flags"] == (False, True, 3, -1)


def test_cli_near_misses_and_defaults_parse():
    from bad_inputs_cli import load_example, parse

    gpt, hf = load_example("train_gpt"), load_example("train_hf")
    args = parse(gpt, "train_gpt", [])  # the defaults themselves pass every check
    assert (args.mesh, args.grad_clip, args.dropout, args.warmup) == (None, 1.0, 0.0, 30)
    args = parse(gpt, "train_gpt", ["--grad-clip", "0", "--dropout", "0", "--warmup", "0", "--lr", "0",
                                    "--save-every", "0", "--mesh", " dp = 1 "])
    assert (args.grad_clip, args.dropout, args.warmup, args.lr, args.save_every, args.mesh) == (0.0, 0.0, 0, 0.0, 0, {"dp": 1})
    args = parse(gpt, "train_gpt", ["--mesh", "pp=2,dp=2", "--batch-size", "16", "--microbatches", "4"])
    assert gpt.mesh_of(args) == {"pp": 2, "dp": 2}
    args = parse(hf, "train_hf", ["--mesh", "dp=1,tp=2", "--zero-stage", "0"])
    assert (hf.mesh_of(args), args.zero_stage) == ({"dp": 1, "tp": 2}, 0)
    assert parse(hf, "train_hf", []).mesh is None
    # pipelines of HF models parse (they used to be refused: "no pipeline path"), with tp too
    args = parse(hf, "train_hf", ["--model", "gemma", "--mesh", "pp=2,tp=2", "--batch-size", "4", "--microbatches", "4"])
    assert (hf.mesh_of(args), args.microbatches, args.schedule) == ({"pp": 2, "tp": 2}, 4, "1f1b")
    # key/value heads tp divides: 8 heads give LLaMA 4 (tp=4 splits them); odd heads keep as many
    assert hf.kv_heads("llama", 8) == 4 and hf.kv_heads("llama", 3) == 3 and hf.kv_heads("gpt2", 8) == 8
    assert parse(hf, "train_hf", ["--mesh", "tp=4", "--heads", "8"]).heads == 8
    assert parse(hf, "train_hf", ["--model", "gpt2", "--mesh", "tp=3", "--heads", "3", "--hidden", "96"]).heads == 3


def _count_real_communication() -> dict:
    import shardlib
    from shardlib.mesh.collectives import raw_reduce_scatter

    mesh = shardlib.init_mesh({"dp": 2})
    originals = {n: getattr(torch.distributed, n, None) for n in COLLECTIVES}
    with CountCollectives() as counter:
        replaced = [n for n in COLLECTIVES if getattr(torch.distributed, n, None) is not originals[n]]
        shardlib.all_reduce(torch.ones(1), "dp")
        shardlib.ppermute(torch.ones(1), "dp", [(0, 1), (1, 0)])
        raw_reduce_scatter(torch.zeros(1), torch.ones(2), mesh, "dp")  # gloo: point-to-point exchange
        torch.distributed.new_group([0, 1])
        found = dict(counter.calls)
    back = all(getattr(torch.distributed, n, None) is originals[n] for n in COLLECTIVES)
    return {"found": found, "comm": mesh.comm.calls(), "replaced": replaced, "back": back}


def test_the_collective_counters_see_communication():
    """The harness can fail: real collectives, point-to-point and group creation are counted."""
    for r in run_on(2, _count_real_communication):
        assert {"all_reduce", "batch_isend_irecv", "isend", "irecv", "new_group"} <= set(r["found"]), r["found"]
        assert r["comm"] >= 3
        assert len(r["replaced"]) >= 20 and r["back"]  # every entry point counted inside, the originals back after
