"""vocab_parallel_cross_entropy against torch.nn.functional.cross_entropy on the full logits.

Each rank gets its torch.chunk slice of the full logits along the vocabulary
(:func:`shardlib.spec.shard_range`; a vocabulary of 37 on 4 ranks is 10 + 10 + 10 + 7) and, for
data-parallel cases, its rows of the batch. Losses and logit gradients are compared with the
single-process ``F.cross_entropy`` (normwise, fp32 rtol 1e-5; float64 rtol 1e-10).

Worker-pool calls are the expensive part, so every case for a mesh goes to the workers in one
``run_on`` call: the fixed cases (one per required feature) through a module fixture, and each
hypothesis example as one batch of random cases.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardlib
from shardlib.mesh.launch import WorkerGroup
from shardlib.parallel.cross_entropy import vocab_parallel_cross_entropy
from shardlib.spec import shard_range
from shardlib.testing import run_on

RTOL = {torch.float32: 1e-5, torch.float64: 1e-10}
MESHES = [{"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 2}]


# -- cases ------------------------------------------------------------------------------------


def make_case(seed, shape, vocab, dtype=torch.float32, ignore_index=-100, ignore_frac=0.25, label_smoothing=0.0,
              reduction="mean", data_axes=(), pass_vocab=True, ignored_rows=None, scale=4.0):
    """Full logits ``shape + (vocab,)``, targets ``shape`` (some set to ``ignore_index``), weights
    for ``reduction="none"``; ``ignored_rows``: a slice of rows whose targets are all ignored."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * scale).to(dtype)
    target = torch.randint(0, vocab, shape, generator=g)
    target[torch.rand(shape, generator=g) < ignore_frac] = ignore_index
    if ignored_rows is not None:
        target[ignored_rows] = ignore_index
    weights = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return {
        "logits": logits, "target": target, "weights": weights, "ignore_index": ignore_index,
        "label_smoothing": label_smoothing, "reduction": reduction, "data_axes": tuple(data_axes),
        "vocab_size": vocab if pass_vocab else None,
    }


def fixed_cases(mesh_shape):
    """One case per required feature, for both dtypes."""
    cases = []
    seed = 0
    for dtype in (torch.float32, torch.float64):
        for vocab in (37, 40):  # 37: no tp size divides it
            for reduction in ("mean", "sum", "none"):
                for eps in (0.0, 0.1):
                    seed += 1
                    cases.append(make_case(seed, (6,), vocab, dtype, reduction=reduction, label_smoothing=eps))
        seed += 1
        cases.append(make_case(seed, (2, 5), 37, dtype, ignore_index=3, label_smoothing=0.1))  # 3-D logits, id 3 ignored
        seed += 1
        cases.append(make_case(seed, (2, 5), 37, dtype, reduction="none", pass_vocab=False))  # V found by all-reduce
        seed += 1
        cases.append(make_case(seed, (4,), 37, dtype, ignore_frac=1.0))  # every target ignored: 0, not NaN
        seed += 1
        cases.append(make_case(seed, (4,), 37, dtype, ignore_frac=1.0, label_smoothing=0.1, reduction="sum"))
        if "dp" in mesh_shape:
            for eps in (0.0, 0.1):
                seed += 1  # dp rank 1's rows are all ignored; the mean is over the global count
                cases.append(make_case(seed, (8,), 37, dtype, label_smoothing=eps, data_axes=("dp",),
                                       ignored_rows=slice(4, 8)))
            seed += 1
            cases.append(make_case(seed, (4, 3), 37, dtype, data_axes=("dp",), ignore_frac=0.5))
    return cases


# -- the worker -------------------------------------------------------------------------------


def _ce_worker(mesh_shape, cases):
    """Per case: this rank's loss, its logit-slice gradient and the collectives it issued."""
    mesh = shardlib.init_mesh(mesh_shape)
    out = []
    for c in cases:
        logits, target, weights = c["logits"], c["target"], c["weights"]
        if c["data_axes"]:
            lo, hi = shard_range(logits.shape[0], mesh.size(c["data_axes"]), mesh.index(c["data_axes"]))
            logits, target, weights = logits[lo:hi], target[lo:hi], weights[lo:hi]
        vocab = c["logits"].shape[-1]
        vlo, vhi = shard_range(vocab, mesh.size("tp"), mesh.index("tp"))
        local = logits[..., vlo:vhi].clone().requires_grad_()
        mesh.comm.reset()
        loss = vocab_parallel_cross_entropy(
            local, target, c["ignore_index"], c["label_smoothing"], c["reduction"],
            vocab_size=c["vocab_size"], data_axes=c["data_axes"], mesh=mesh,
        )
        calls = mesh.comm.calls()
        (loss * weights).sum().backward() if c["reduction"] == "none" else loss.backward()
        out.append({"loss": loss.detach(), "grad": local.grad, "coords": mesh.coords(), "calls": calls})
    return out


def run_cases(mesh_shape, cases):
    world = math.prod(mesh_shape.values())
    if world == 1:
        return [_ce_worker(mesh_shape, cases)]
    return run_on(world, _ce_worker, mesh_shape, cases)


# -- the reference and the comparison ---------------------------------------------------------


def reference(c):
    logits = c["logits"].clone().requires_grad_()
    vocab = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, vocab), c["target"].reshape(-1), ignore_index=c["ignore_index"],
                           reduction=c["reduction"], label_smoothing=c["label_smoothing"])
    if c["reduction"] == "none":
        loss = loss.view(c["target"].shape)
        (loss * c["weights"]).sum().backward()
    else:
        loss.backward()
    return loss.detach(), logits.grad


def close(actual, expected, rtol, what):
    """Normwise: max |actual - expected| <= rtol * max(max |expected|, 1)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{what}: not finite: {actual}"
    if not expected.numel():
        return
    err = (actual.double() - expected.double()).abs().max().item()
    scale = max(expected.double().abs().max().item(), 1.0)
    assert err <= rtol * scale, f"{what}: max |diff| {err:.3e} > {rtol:g} x {scale:.3e}"


def check(mesh_shape, cases, results, rtol=None):
    """Every rank's loss and gradient slice against the reference, for every case."""
    tp = mesh_shape["tp"]
    for i, c in enumerate(cases):
        label = (f"case {i} mesh {mesh_shape} V={c['logits'].shape[-1]} {c['logits'].dtype} {c['reduction']} "
                 f"eps={c['label_smoothing']} data_axes={c['data_axes']}")
        tol = rtol or RTOL[c["logits"].dtype]
        vocab = c["logits"].shape[-1]
        all_ignored = bool((c["target"] == c["ignore_index"]).all())
        ref_loss, ref_grad = reference(c)
        if all_ignored and c["reduction"] == "mean":
            assert torch.isnan(ref_loss)  # torch divides by a count of zero; shardlib defines it as 0
            ref_loss, ref_grad = torch.zeros_like(ref_loss), torch.zeros_like(ref_grad)
        ranks = [r[i] for r in results]
        dp = mesh_shape.get("dp", 1) if c["data_axes"] else 1
        for r in ranks:
            vlo, vhi = shard_range(vocab, tp, r["coords"]["tp"])
            assert r["loss"].dtype == torch.float32 or r["loss"].dtype == c["logits"].dtype, label
            assert r["grad"].dtype == c["logits"].dtype, label
            rows = slice(None)
            if dp > 1:
                rows = slice(*shard_range(c["logits"].shape[0], dp, r["coords"]["dp"]))
                # DDP averages over dp: the average of the per-rank gradients is the global one.
                close(r["grad"] / dp, ref_grad[rows][..., vlo:vhi], tol, f"{label}: gradient on rank {r['coords']}")
                continue
            close(r["loss"], ref_loss, tol, f"{label}: loss on rank {r['coords']}")
            close(r["grad"], ref_grad[..., vlo:vhi], tol, f"{label}: gradient on rank {r['coords']}")
        if dp > 1:  # the dp-average of the per-rank losses is the global mean
            for t in range(tp):
                losses = [r["loss"] for r in ranks if r["coords"]["tp"] == t]
                assert len(losses) == dp
                for loss in losses:
                    assert torch.isfinite(loss).all(), f"{label}: loss {loss} on a rank"
                close(torch.stack(losses).mean(), ref_loss, tol, f"{label}: dp-averaged loss")


# -- fixed cases, one pool call per mesh -------------------------------------------------------


@pytest.fixture(scope="module")
def fixed_results():
    out = {}

    def get(mesh_key):
        if mesh_key not in out:
            mesh_shape = dict(mesh_key)
            cases = fixed_cases(mesh_shape)
            out[mesh_key] = (mesh_shape, cases, run_cases(mesh_shape, cases))
        return out[mesh_key]

    return get


def _select(cases, results, keep):
    idx = [i for i, c in enumerate(cases) if keep(c)]
    return [cases[i] for i in idx], [[r[i] for i in idx] for r in results]


MESH_PARAMS = [pytest.param({"tp": 1}, id="tp1")] + [
    pytest.param(m, id="x".join(f"{a}{n}" for a, n in m.items()), marks=pytest.mark.multiprocess) for m in MESHES
]


@pytest.mark.parametrize("mesh_shape", MESH_PARAMS)
def test_fp32_matches_torch(fixed_results, mesh_shape):
    """fp32: ignore_index rows (-100 and a real class id), label smoothing 0 and 0.1, reductions
    mean/sum/none, V = 37 (no tp size divides it) and 40, 2-D and 3-D logits, V found by an
    all-reduce, a batch whose targets are all ignored (0, not NaN), and on dp x tp the mean over
    the global count of valid tokens with dp rank 1's targets all ignored."""
    shape, cases, results = fixed_results(tuple(mesh_shape.items()))
    check(shape, *_select(cases, results, lambda c: c["logits"].dtype == torch.float32))


@pytest.mark.parametrize("mesh_shape", MESH_PARAMS)
def test_float64_matches_torch_at_float32_precision(fixed_results, mesh_shape):
    shape, cases, results = fixed_results(tuple(mesh_shape.items()))
    check(shape, *_select(cases, results, lambda c: c["logits"].dtype == torch.float64), rtol=1e-5)


@pytest.mark.parametrize("mesh_shape", MESH_PARAMS)
def test_float64_matches_torch_at_float64_precision(fixed_results, mesh_shape):
    shape, cases, results = fixed_results(tuple(mesh_shape.items()))
    check(shape, *_select(cases, results, lambda c: c["logits"].dtype == torch.float64))


@pytest.mark.multiprocess
def test_dp_mean_is_over_the_global_count_and_all_ignored_rank_has_no_nan(fixed_results):
    """On {dp: 2, tp: 2} with data_axes=("dp",): a dp rank whose targets are all ignored returns a
    finite loss (0) and zero gradients; the other rank's loss is its sum over the GLOBAL count of
    valid targets times dp, so the dp-average of losses and gradients is the global mean's."""
    shape, cases, results = fixed_results((("dp", 2), ("tp", 2)))
    idx = [i for i, c in enumerate(cases) if c["data_axes"] and c["target"].shape == (8,)]
    assert len(idx) == 4  # eps 0 and 0.1, fp32 and fp64
    for i in idx:
        c = cases[i]
        assert (c["target"][4:] == -100).all() and (c["target"][:4] != -100).any()
        valid = int((c["target"] != -100).sum())
        ref_loss, _ = reference(c)
        for rank in results:
            r = rank[i]
            if r["coords"]["dp"] == 1:
                assert r["loss"].item() == 0.0 and not r["grad"].abs().any()
            else:
                logits = c["logits"][:4].double().requires_grad_()
                local_sum = F.cross_entropy(logits, c["target"][:4], reduction="sum", label_smoothing=c["label_smoothing"])
                assert r["loss"].item() == pytest.approx(2 * local_sum.item() / valid, rel=1e-5)
                assert r["loss"].item() == pytest.approx(2 * ref_loss.item(), rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_shape", MESHES, ids=["tp2", "tp4", "dp2xtp2"])
def test_three_all_reduces_over_tp(fixed_results, mesh_shape):
    """Megatron's count: max, sum of exponentials, target logit (+ the smoothing sum, stacked
    with it) are three all-reduces over tp; one more finds V when it is not given, and one over
    dp counts the valid targets for a global mean."""
    shape, cases, results = fixed_results(tuple(mesh_shape.items()))
    for i, c in enumerate(cases):
        expected = 3 + (c["vocab_size"] is None) + bool(c["data_axes"] and c["reduction"] == "mean")
        assert {r[i]["calls"] for r in results} == {expected}, (i, c["reduction"], c["data_axes"])


# -- hypothesis: random shapes and vocabularies, one pool call per example --------------------


@st.composite
def random_cases(draw, mesh_shape):
    cases = []
    tp = mesh_shape["tp"]
    for _ in range(draw(st.integers(3, 6))):
        vocab = draw(st.one_of(st.sampled_from([37, 41, 13, 2 * tp + 1, 3 * tp]), st.integers(tp, 64)))
        if shard_range(vocab, tp, tp - 1)[1] == shard_range(vocab, tp, tp - 1)[0]:
            vocab = 3 * tp + 1  # no empty shards here (see test_vocabulary_with_empty_shards)
        rows = draw(st.integers(1, 4)) * mesh_shape.get("dp", 1)
        shape = (rows,) if draw(st.booleans()) else (rows, draw(st.integers(1, 3)))
        reduction = draw(st.sampled_from(["mean", "sum", "none"]))
        data_axes = ("dp",) if "dp" in mesh_shape and reduction == "mean" and draw(st.booleans()) else ()
        cases.append(make_case(
            draw(st.integers(0, 2**16)), shape, vocab,
            ignore_index=draw(st.sampled_from([-100, 0, vocab - 1])),
            ignore_frac=draw(st.sampled_from([0.0, 0.3])),
            label_smoothing=draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])),
            reduction=reduction, data_axes=data_axes, pass_vocab=draw(st.booleans()),
            scale=draw(st.sampled_from([1.0, 10.0])),
        ))
    return cases


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh_shape", MESHES, ids=["tp2", "tp4", "dp2xtp2"])
@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_shapes_and_vocabularies(mesh_shape, data):
    cases = data.draw(random_cases(mesh_shape))
    check(mesh_shape, cases, run_cases(mesh_shape, cases))


@pytest.mark.multiprocess
def test_vocabulary_with_empty_shards():
    """V = 2, 3, 5 on tp = 4 leave the last rank(s) with no vocabulary (torch.chunk layout):
    they contribute nothing and still get a (0-wide) gradient, with no NaN. A private worker
    group: while the bug stands, the failing ranks take the group down (the shared pool is kept)."""
    mesh_shape = {"tp": 4}
    cases = [make_case(s, (5,), v, reduction=red, label_smoothing=eps, pass_vocab=pv)
             for s, (v, red, eps, pv) in enumerate([(2, "mean", 0.0, True), (3, "sum", 0.1, False),
                                                    (5, "none", 0.1, True), (5, "mean", 0.0, False)])]
    assert shard_range(5, 4, 3) == (5, 5) and shard_range(2, 4, 2) == (2, 2)
    group = WorkerGroup(4, timeout=30)
    try:
        results = group.run(_ce_worker, mesh_shape, cases)
    finally:
        group.close()
    check(mesh_shape, cases, results)


# -- argument checks (one rank) ---------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"reduction": "avg"}, "reduction must be 'mean', 'sum' or 'none', got 'avg'"),
    ({"label_smoothing": 1.5}, r"label_smoothing must be in \[0, 1\], got 1.5"),
    ({"vocab_size": 41}, r"local logits have width 37 .* should hold vocabulary \[0, 41\) of 41"),
])
def test_bad_arguments_raise(kwargs, match):
    mesh = shardlib.init_mesh({"tp": 1})
    with pytest.raises(ValueError, match=match):
        vocab_parallel_cross_entropy(torch.zeros(3, 37), torch.zeros(3, dtype=torch.long), mesh=mesh, **kwargs)


@pytest.mark.parametrize("logits, target, match", [
    # a (T, B) target for (B, T, V) logits and an (N, 1) target were paired by flat order, silently
    ((2, 3, 37), torch.zeros(3, 2, dtype=torch.long), r"target of shape \(3, 2\) does not match logits_local of shape "
     r"\(2, 3, 37\): it needs one class id per row of logits, shape \(2, 3\)"),
    ((6, 37), torch.zeros(6, 1, dtype=torch.long), r"target of shape \(6, 1\) does not match"),
    ((6, 37), torch.zeros(6, 37), "takes class ids .* got torch.float32: class probabilities are not supported"),
], ids=["transposed", "column", "probabilities"])
def test_bad_targets_raise_before_communicating(logits, target, match):
    mesh = shardlib.init_mesh({"tp": 1})
    mesh.comm.reset()
    with pytest.raises(ValueError, match=match):
        vocab_parallel_cross_entropy(torch.zeros(logits), target, mesh=mesh)  # vocab_size=None: an exchange follows
    assert mesh.comm.calls() == 0


@pytest.mark.parametrize("target", [[0, 37, 1], [0, -1, 1], [0, -101, 1]], ids=["V", "minus_one", "below_ignore"])
def test_class_ids_outside_the_vocabulary_raise_as_f_cross_entropy_does(target):
    """A class id outside ``[0, V)`` that is not ``ignore_index``: ``F.cross_entropy`` raises
    (IndexError on CPU, a device-side assert on CUDA); the vocabulary-parallel loss took the
    row's logsumexp as its loss, silently (found by a new-user pass: a tokenizer larger than the
    model's vocabulary trains on). Now an asynchronous assert (no host sync on CUDA) refuses it,
    before any communication when ``vocab_size`` is given, after the width exchange otherwise."""
    t = torch.tensor(target)
    with pytest.raises(IndexError):
        F.cross_entropy(torch.zeros(3, 37), t)
    mesh = shardlib.init_mesh({"tp": 1})
    mesh.comm.reset()
    with pytest.raises(RuntimeError, match=r"a target class id is outside \[0, V\) and is not ignore_index \(-100\)"):
        vocab_parallel_cross_entropy(torch.zeros(3, 37), t, vocab_size=37, mesh=mesh)
    assert mesh.comm.calls() == 0
    with pytest.raises(RuntimeError, match=r"a target class id is outside \[0, V\)"):
        vocab_parallel_cross_entropy(torch.zeros(3, 37), t, mesh=mesh)  # V exchanged first
    assert vocab_parallel_cross_entropy(torch.zeros(3, 37), torch.tensor([0, -100, 36]), vocab_size=37, mesh=mesh) \
        == pytest.approx(math.log(37))  # ignore_index and both ends of [0, V) are accepted


# -- the fused path with exchanged widths (the CUDA dispatch, forced on CPU) ---------------------


def _fused_exchanged_worker(full, target, eps):
    """vocab_parallel_cross_entropy(vocab_size=None) through the fused autograd function (its
    kernels run their torch references on CPU): ``lo`` and ``V`` are device tensors there, and
    label smoothing reads ``V`` once in backward."""
    from shardlib.parallel import cross_entropy as pce

    mesh = shardlib.init_mesh({"tp": 2})
    lo, hi = shard_range(full.shape[-1], 2, mesh.index("tp"))
    leaf = full[:, lo:hi].clone().requires_grad_()
    original = pce._fused_applies
    pce._fused_applies = lambda flat: flat.shape[1] > 0
    try:  # the worker is reused by other tests: restore the dispatch
        mesh.comm.reset()
        loss = pce.vocab_parallel_cross_entropy(leaf * 1, target, label_smoothing=eps, mesh=mesh)
        calls = mesh.comm.calls("tp")
        loss.backward()
    finally:
        pce._fused_applies = original
    return loss.detach(), leaf.grad, calls


@pytest.mark.multiprocess
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_fused_path_with_exchanged_vocabulary_size(eps):
    """The GPU dispatch with vocab_size=None on tp 2 (V = 37: 19 + 18), float64, against
    F.cross_entropy on the full logits (rtol 1e-10): the width exchange plus the three
    all-reduces, the global V and this rank's first id kept as device tensors."""
    g = torch.Generator().manual_seed(11)
    full = torch.randn(6, 37, generator=g, dtype=torch.float64) * 4
    target = torch.randint(0, 37, (6,), generator=g)
    target[1] = -100
    ref = full.clone().requires_grad_()
    want = F.cross_entropy(ref, target, label_smoothing=eps)
    want.backward()
    results = run_on(2, _fused_exchanged_worker, full, target, eps)
    for loss, _, calls in results:
        close(loss, want.detach(), 1e-10, f"eps={eps}: loss")
        assert calls == 4
    close(torch.cat([grad for _, grad, _ in results], dim=-1), ref.grad, 1e-10, f"eps={eps}: gradient")
