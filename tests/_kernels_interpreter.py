"""Triton kernels in Triton's interpreter, against their torch references (CPU, tiny shapes).

Not collected on its own (the name does not match ``test_*.py``): ``tests/test_kernels.py``
runs it in a subprocess with ``TRITON_INTERPRET=1`` (which must be set before ``triton`` is
imported, so it cannot share a process with the other tests) and
``SHARDLIB_KERNELS_FORCE_TRITON=1`` (Triton programs on CPU tensors). To run it by hand:

    TRITON_INTERPRET=1 SHARDLIB_KERNELS_FORCE_TRITON=1 python -m pytest -q tests/_kernels_interpreter.py

Tolerances. fp32: the kernel and the reference do the same fp32 arithmetic but may reduce in a
different order or contract multiply-adds, so they agree to a few fp32 ulps (rtol/atol 1e-5 on
values of order 1; AdamW, purely elementwise, to 1e-6). fp16: both accumulate in fp32 and
round the result to fp16 once, so they differ by at most about one fp16 ulp (2**-10 relative):
rtol/atol 2e-3. bf16 is skipped: the interpreter computes bf16 wrongly (numpy has no bfloat16);
bf16 is checked on a GPU by ``tests/test_kernels.py::test_kernels_on_cuda`` and
``benchmarks/kernels_gpu.py``.
"""

import os

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("SHARDLIB_KERNELS_FORCE_TRITON") != "1":
    pytest.skip("run through tests/test_kernels.py (needs TRITON_INTERPRET=1 SHARDLIB_KERNELS_FORCE_TRITON=1)",
                allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed")

import shardlib  # noqa: E402
from shardlib import kernels  # noqa: E402
from shardlib.kernels import adamw as kadamw  # noqa: E402
from shardlib.kernels import cross_entropy as kce  # noqa: E402
from shardlib.kernels import norms as knorms  # noqa: E402
from shardlib.parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3)}
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skip(
    reason="the Triton interpreter computes bf16 wrongly (numpy has no bfloat16); bf16 runs on GPU only "
           "(tests/test_kernels.py::test_kernels_on_cuda, benchmarks/kernels_gpu.py)"))
DTYPES = [torch.float32, torch.float16, BF16]


@pytest.fixture(autouse=True)
def _no_reference(monkeypatch, request):
    """Fail if an op silently falls back to its reference: these tests must run Triton (the GPU
    check script compares with the references itself, and checks that Triton runs)."""
    if request.node.name.startswith("test_gpu_check_script"):
        return
    def boom(*a, **k):
        raise AssertionError("the torch reference ran where the Triton program should have")
    for mod, name in ((kadamw, "adamw_reference_"), (knorms, "norm_reference"), (knorms, "norm_backward_reference"),
                      (kce, "vocab_ce_stats_reference"), (kce, "vocab_ce_grad_reference_")):
        monkeypatch.setattr(mod, name, boom)


def test_interpreter_is_on():
    assert kernels.HAS_TRITON and kernels.use_triton(torch.zeros(1))


# -- AdamW --------------------------------------------------------------------------------------


@pytest.mark.parametrize("copy_dtype", [None, torch.float16, BF16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16])
def test_adamw_kernel_matches_reference(grad_dtype, copy_dtype):
    g = torch.Generator().manual_seed(0)
    n = 2500  # not a multiple of the block (1024): the masked tail
    p = torch.randn(n, generator=g)
    m, v = torch.zeros(n), torch.zeros(n)
    ref = [t.clone() for t in (p, m, v)]
    copy = torch.empty(n, dtype=copy_dtype) if copy_dtype else None
    for step in (1, 2, 3):
        grad = torch.randn(n, generator=g).to(grad_dtype)
        kadamw.adamw_(p, grad, m, v, copy, 1e-2, 0.9, 0.95, 1e-8, 0.1, float(step))
        _adamw_torch(*ref, grad, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
    for got, want in zip((p, m, v), ref):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    if copy is not None:
        assert torch.equal(copy, p.to(copy_dtype))  # the copy is the rounded new master weight


def _adamw_torch(p, m, v, grad, lr, b1, b2, eps, wd, step):
    """torch.optim.AdamW's single-tensor update (the reference is patched out in this module)."""
    grad = grad.float()
    p.mul_(1 - lr * wd)
    m.lerp_(grad, 1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
    denom = (v.sqrt() / (1 - b2 ** step) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - b1 ** step))


def test_fused_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    w0 = [torch.randn(1500), torch.randn(7)]
    ours = [torch.nn.Parameter(w.clone()) for w in w0]
    theirs = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = kernels.FusedAdamW(ours, lr=3e-3, betas=(0.8, 0.99), weight_decay=0.05)
    ref = torch.optim.AdamW(theirs, lr=3e-3, betas=(0.8, 0.99), weight_decay=0.05)
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        sa, sb = opt.state[a], ref.state[b]
        assert sa.keys() == sb.keys() and torch.equal(sa["step"], sb["step"])
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-6, atol=1e-12)


# -- LayerNorm / RMSNorm -------------------------------------------------------------------------


@pytest.mark.parametrize("affine", ["wb", "w", "none"])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_kernels_match_reference(dtype, rms, affine):
    if rms and affine == "wb":
        pytest.skip("RMSNorm has no bias")
    g = torch.Generator().manual_seed(1)
    n, c = 11, 40  # 11 rows over 4 programs (3, 3, 3, 2); 40 columns in a block of 64
    x = (torch.randn(n, c, generator=g) * 2 + 0.5).to(dtype)
    w = torch.randn(c, generator=g).to(dtype) if affine != "none" else None
    b = torch.randn(c, generator=g).to(dtype) if affine == "wb" else None
    dy = torch.randn(n, c, generator=g).to(dtype)
    eps = 1e-5
    y, mean, rstd = knorms.norm_forward(x, w, b, eps, rms)
    dx, dw, db = knorms.norm_backward(dy, x, w, mean, rstd, b is not None, rms)
    y_ref, mean_ref, rstd_ref = _norm_ref(x, w, b, eps, rms)
    dx_ref, dw_ref, db_ref = _norm_bwd_ref(dy, x, w, mean_ref, rstd_ref, b is not None, rms)
    tol = TOL[dtype]
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(rstd, rstd_ref, rtol=1e-5, atol=1e-6)
    if not rms:
        torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, dx_ref, **tol)
    # weight/bias grads sum 11 rows: same fp32 sum in another order, then one rounding
    torch.testing.assert_close(dw, dw_ref, **tol)
    torch.testing.assert_close(db, db_ref, **tol)


_ORIGINAL = {}


def _norm_ref(*args):
    return _ORIGINAL["norm_reference"](*args)


def _norm_bwd_ref(*args):
    return _ORIGINAL["norm_backward_reference"](*args)


def _ce_stats_ref(*args):
    return _ORIGINAL["vocab_ce_stats_reference"](*args)


def _ce_grad_ref(*args):
    return _ORIGINAL["vocab_ce_grad_reference_"](*args)


_ORIGINAL.update(norm_reference=knorms.norm_reference, norm_backward_reference=knorms.norm_backward_reference,
                 vocab_ce_stats_reference=kce.vocab_ce_stats_reference,
                 vocab_ce_grad_reference_=kce.vocab_ce_grad_reference_)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_autograd_matches_torch(dtype):
    """Through the public functions and autograd, against F.layer_norm / F.rms_norm in float64."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 24, generator=g).to(dtype).requires_grad_()
    w = torch.randn(24, generator=g).to(dtype).requires_grad_()
    b = torch.randn(24, generator=g).to(dtype).requires_grad_()
    dy = torch.randn(2, 3, 24, generator=g).to(dtype)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    for ours, theirs in (
        (lambda: kernels.layer_norm(x, (24,), w, b), lambda: F.layer_norm(x64, (24,), w64, b64)),
        (lambda: kernels.rms_norm(x, (24,), w, eps=1e-6), lambda: F.rms_norm(x64, (24,), w64, eps=1e-6)),
    ):
        y = ours()
        grads = torch.autograd.grad(y, (x, w), dy)
        y64 = theirs()
        grads64 = torch.autograd.grad(y64, (x64, w64), dy.double())
        assert y.dtype == dtype
        torch.testing.assert_close(y.double(), y64, **TOL[dtype])
        for got, want in zip(grads, grads64):
            torch.testing.assert_close(got.double(), want, **TOL[dtype])


# -- vocab-parallel cross-entropy ----------------------------------------------------------------


@pytest.mark.parametrize("block", [16, 4096])  # 16: the row is walked in 3 blocks (online max/sum)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ce_kernels_match_reference(dtype, block, monkeypatch):
    monkeypatch.setattr(kce, "_MAX_BLOCK", block)
    g = torch.Generator().manual_seed(3)
    n, v = 9, 37
    logits = (torch.randn(n, v, generator=g) * 4).to(dtype)
    t = torch.randint(-3, v + 3, (n,), generator=g)  # some outside this slice
    m, s, xt, sx = kce.vocab_ce_stats(logits, t, True)
    m_r, s_r, xt_r, sx_r = _ce_stats_ref(logits, t, True)
    torch.testing.assert_close(m, m_r, rtol=0, atol=0)  # a max is exact
    torch.testing.assert_close(s, s_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xt, xt_r, rtol=0, atol=0)
    torch.testing.assert_close(sx, sx_r, rtol=1e-5, atol=1e-4)
    gm, gs = m + 0.5, s * 1.7  # as if other slices held larger logits
    up = torch.randn(n, generator=g)
    got, want = logits.clone(), logits.clone()
    kce.vocab_ce_grad_(got, t, gm, gs, up, 0.1 / 100, 0.9)
    _ce_grad_ref(want, t, gm, gs, up, 0.1 / 100, 0.9)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_vocab_parallel_ce_fused_matches_f_cross_entropy(dtype, eps, monkeypatch):
    """The whole fused path (one tp rank) against F.cross_entropy in float64; the gradient lands
    in the logits buffer itself."""
    monkeypatch.setattr(kce, "_MAX_BLOCK", 16)
    mesh = shardlib.init_mesh({"tp": 1})
    g = torch.Generator().manual_seed(4)
    full = (torch.randn(2, 5, 37, generator=g) * 4).to(dtype)
    target = torch.randint(0, 37, (2, 5), generator=g)
    target[0, :2] = -100
    leaf = full.clone().requires_grad_()
    logits = leaf * 1  # a non-leaf, like a matmul output: backward writes into it
    assert kce.fused_ce_applies(logits.reshape(10, 37))
    loss = vocab_parallel_cross_entropy(logits, target, label_smoothing=eps, mesh=mesh)
    loss.backward()
    ref = full.double().requires_grad_()
    F.cross_entropy(ref.reshape(10, 37), target.reshape(10), label_smoothing=eps).backward()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), F.cross_entropy(full.double().reshape(10, 37), target.reshape(10),
                                                              label_smoothing=eps), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double(), ref.grad, **TOL[dtype])
    assert torch.equal(logits.detach(), leaf.grad)  # in place: the logits now hold their gradient
    assert leaf.grad[0, :2].abs().max() == 0  # ignored targets: zero gradient


# -- the model and the optimizer use the kernels ---------------------------------------------------


def test_gpt_and_zero_optimizer_use_kernels():
    """GPT (LayerNorm kernels) + ZeroOptimizer (FusedAdamW) for two steps on one rank, against
    the same run with kernels off (plain nn.LayerNorm and torch.optim.AdamW). fp32 rtol 1e-5:
    the kernels reorder fp32 sums in LayerNorm."""
    from shardlib.models import GPT, GPTConfig

    mesh = shardlib.init_mesh({"dp": 1})
    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)
    idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(5))
    runs = []
    for on in (True, False):
        with kernels.use_kernels(on):
            torch.manual_seed(0)
            smodel = shardlib.shard(GPT(cfg), mesh, zero_stage=1)
            opt = shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-2)
            assert (type(opt.optimizer) is kernels.FusedAdamW) == on
            losses = []
            for _ in range(2):
                _, loss = smodel(idx, idx)
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            runs.append((torch.stack(losses), shardlib.full_state_dict(smodel)))
    (l_on, p_on), (l_off, p_off) = runs
    torch.testing.assert_close(l_on, l_off, rtol=1e-5, atol=1e-6)
    for name in p_off:
        if name.endswith("k_proj.bias"):
            # its gradient is zero in exact arithmetic (a key bias shifts every score of a query
            # row equally; softmax ignores it), so Adam turns rounding noise into +-lr steps
            continue
        torch.testing.assert_close(p_on[name], p_off[name], rtol=1e-5, atol=1e-6)


def test_opcheck_triton_path():
    """Schemas, autograd registration and fake implementations against the Triton outputs."""
    g = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(5, 8, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g)
    t = torch.tensor([0, 3, -1, 7, 2])
    m, s, _, _ = kce.vocab_ce_stats(x, t, False)
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    for op, args in (
        (knorms.norm_forward, (x.clone().requires_grad_(), w.clone().requires_grad_(), b, 1e-5, False)),
        (kce.vocab_ce_stats, (x, t, True)),
        (kce.vocab_ce_grad_, (x.clone(), t, m, s, torch.ones(5), 0.0, 1.0)),
        (kadamw.adamw_, (torch.randn(16), torch.randn(16), torch.zeros(16), torch.zeros(16), None,
                         1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0)),
    ):
        torch.library.opcheck(op, args, test_utils=checks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_check_script_runs_here(dtype, monkeypatch):
    """benchmarks/kernels_gpu.py's correctness pass, on tiny shapes (the GPU run uses the same code)."""
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from benchmarks.kernels_gpu import check_correctness

    errs = check_correctness(dtype, torch.device("cpu"), small=True)
    assert len(errs) >= 15 and max(errs.values()) < {torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    assert "benchmarks" in sys.modules
