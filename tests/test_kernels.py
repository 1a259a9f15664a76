"""shardlib.kernels: the torch references against torch's own ops, the custom ops' fake
implementations (``torch.library.opcheck``), the on/off switch, and every Triton program in
Triton's interpreter (a subprocess running ``tests/_kernels_interpreter.py``).

The interpreter must be chosen before ``triton`` is imported (``TRITON_INTERPRET=1``), and this
process may have imported triton already (another test, a plugin), so the Triton programs run in
a separate Python process;
its own docstring gives the tolerances. bf16 runs only on a GPU (:func:`test_kernels_on_cuda`):
the interpreter computes bf16 wrongly.

Tolerances here: the references do the same arithmetic as torch's ops where that is possible
(AdamW: bit for bit equal), else are compared in float64 (1e-10) and float32 (1e-5).
"""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shardlib
from shardlib import kernels
from shardlib.kernels import _dispatch
from shardlib.kernels import cross_entropy as kce
from shardlib.kernels import norms as knorms
from shardlib.parallel.cross_entropy import fused_vocab_parallel_ce, vocab_parallel_cross_entropy
from shardlib.spec import shard_range
from shardlib.testing import run_on

HERE = Path(__file__).resolve().parent


# -- AdamW ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_reference_equals_torch_adamw_bitwise(weight_decay):
    torch.manual_seed(0)
    w0 = torch.randn(300)
    p, m, v = w0.clone(), torch.zeros(300), torch.zeros(300)
    q = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([q], lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay, foreach=False)
    for step in range(1, 5):
        g = torch.randn(300)
        q.grad = g.clone()
        opt.step()
        kernels.adamw_reference_(p, g, m, v, None, 1e-2, 0.8, 0.95, 1e-6, weight_decay, float(step))
    assert torch.equal(p, q.detach())
    assert torch.equal(m, opt.state[q]["exp_avg"]) and torch.equal(v, opt.state[q]["exp_avg_sq"])


def test_adamw_op_writes_param_copy():
    p, g = torch.randn(50), torch.randn(50)
    m, v, copy = torch.zeros(50), torch.zeros(50), torch.empty(50, dtype=torch.bfloat16)
    kernels.adamw_(p, g, m, v, copy, 1e-2, 0.9, 0.999, 1e-8, 0.0, 1.0)
    assert torch.equal(copy, p.to(torch.bfloat16))


def test_adamw_op_errors():
    p = torch.zeros(4)
    with pytest.raises(TypeError, match="float32"):
        kernels.adamw_(p.half(), p, p.clone(), p.clone(), None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0)
    with pytest.raises(ValueError, match="grad has shape"):
        kernels.adamw_(p, torch.zeros(5), p.clone(), p.clone(), None, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0)


def test_fused_adamw_is_torch_adamw_on_cpu():
    """On CPU FusedAdamW is torch's AdamW (fallback): same values, state keys and state_dict,
    and a torch AdamW checkpoint loads into it."""
    torch.manual_seed(1)
    w0 = torch.randn(10, 3)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    oa = kernels.FusedAdamW([a], lr=1e-2)
    ob = torch.optim.AdamW([b], lr=1e-2)
    copy = torch.empty(10, 3, dtype=torch.float16)
    oa.set_param_copy(a, copy)
    calls = []
    oa.register_step_pre_hook(lambda *args: calls.append(1))
    for _ in range(2):
        g = torch.randn(10, 3)
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b) and torch.equal(copy, a.detach().half())
    assert len(calls) == 2  # step hooks once per step, also on the fallback path
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sa["state"][0].keys() == sb["state"][0].keys()
    oa2 = kernels.FusedAdamW([torch.nn.Parameter(w0.clone())], lr=1e-2)
    oa2.load_state_dict(sb)
    assert torch.equal(oa2.state_dict()["state"][0]["exp_avg"], sb["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match="copy has shape"):
        oa.set_param_copy(a, torch.empty(3))


@pytest.mark.parametrize("n", [kernels.CPU_BLOCK * 3, kernels.CPU_BLOCK * 2 + 37, 100])
def test_fused_adamw_cpu_blocks_equal_torch_adamw_bitwise(n):
    """The CPU path runs torch's single-tensor update block by block (CPU_BLOCK elements): the
    same arithmetic per element, so parameters and both moments equal torch.optim.AdamW's
    exactly, also for a length that leaves a partial last block."""
    torch.manual_seed(2)
    w0 = torch.randn(n)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    oa = kernels.FusedAdamW([a], lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    ob = torch.optim.AdamW([b], lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)
    copy = torch.empty(n, dtype=torch.bfloat16)
    oa.set_param_copy(a, copy)
    for _ in range(3):
        g = torch.randn(n) * 1e-3
        a.grad, b.grad = g.clone(), g.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b) and torch.equal(copy, b.detach().bfloat16())
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(oa.state[a][key], ob.state[b][key]), key


def test_zero_optimizer_picks_fused_adamw_on_cpu_unless_told_otherwise():
    mesh = shardlib.init_mesh({"dp": 1})
    smodel = shardlib.shard(torch.nn.Linear(4, 2), mesh)
    assert type(shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3).optimizer) is kernels.FusedAdamW
    # the caller chose torch's implementation, or turned the kernels off: torch's AdamW as given
    assert type(shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3, foreach=True).optimizer) is torch.optim.AdamW
    with kernels.use_kernels(False):
        assert type(shardlib.ZeroOptimizer(smodel, torch.optim.AdamW, lr=1e-3).optimizer) is torch.optim.AdamW
    assert type(shardlib.ZeroOptimizer(smodel, torch.optim.SGD, lr=1e-3).optimizer) is torch.optim.SGD


# -- norms ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
def test_norm_references_match_torch(dtype, tol, affine):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 5, 12, generator=g, dtype=torch.float64) * 3 + 1).to(dtype).requires_grad_()
    w = torch.randn(12, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if affine != "none" else None
    b = torch.randn(12, generator=g, dtype=torch.float64).to(dtype).requires_grad_() if affine == "wb" else None
    dy = torch.randn(3, 5, 12, generator=g, dtype=torch.float64).to(dtype)
    inputs = [t for t in (x, w, b) if t is not None]
    for ours, theirs in (
        (lambda: kernels.layer_norm(x, (12,), w, b, eps=1e-5), lambda: F.layer_norm(x, (12,), w, b, eps=1e-5)),
        (lambda: kernels.rms_norm(x, 12, w), lambda: F.rms_norm(x, (12,), w)),  # eps None: finfo.eps, as torch
    ):
        got = ours()
        grads = torch.autograd.grad(got, inputs, dy, allow_unused=True)
        want = theirs()
        wgrads = torch.autograd.grad(want, inputs, dy, allow_unused=True)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        for a, c in zip(grads, wgrads):
            if c is None:  # rms_norm has no bias
                assert a is None
            else:
                torch.testing.assert_close(a, c, rtol=tol, atol=tol)


def test_norm_half_precision_accumulates_in_fp32():
    """fp16 rows whose squares overflow fp16 (x ~ 300: x**2 > 65504): fp32 statistics keep them finite."""
    x = torch.full((2, 64), 300.0, dtype=torch.float16) + torch.arange(64, dtype=torch.float16)
    y = kernels.rms_norm(x, 64)
    ref = F.rms_norm(x.double(), (64,), eps=torch.finfo(torch.float16).eps)
    assert y.dtype == torch.float16 and torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), ref, rtol=2e-3, atol=2e-3)


def test_norm_gradcheck_float64():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: kernels.layer_norm(x, 6, w, b), (x, w, b))
    assert torch.autograd.gradcheck(lambda x, w: kernels.rms_norm(x, 6, w, eps=1e-6), (x, w))


def test_norm_shape_errors():
    with pytest.raises(ValueError, match="does not end in normalized_shape"):
        kernels.layer_norm(torch.zeros(2, 5), (4,))
    with pytest.raises(ValueError, match="weight has shape"):
        kernels.rms_norm(torch.zeros(2, 4), (4,), torch.zeros(5))


def test_gpt_layernorm_is_nn_layernorm_on_cpu():
    from shardlib.models.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2, block_size=8))
    assert isinstance(model.ln_f, torch.nn.LayerNorm)
    x = torch.randn(2, 3, 16)
    assert torch.equal(model.ln_f(x), F.layer_norm(x, (16,), model.ln_f.weight, model.ln_f.bias))


# -- cross-entropy -------------------------------------------------------------------------------


def test_ce_references_give_f_cross_entropy():
    """The reference phases, combined as on one rank, give F.cross_entropy's loss and gradient."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 11, generator=g, dtype=torch.float64) * 3
    t = torch.randint(0, 11, (6,), generator=g)
    eps = 0.2
    m, s, xt, sx = kce.vocab_ce_stats_reference(x, t, True)
    log_z = m + s.log()
    loss = (1 - eps) * (log_z - xt) + eps * (log_z - sx / 11)
    ref = x.clone().requires_grad_()
    want = F.cross_entropy(ref, t, label_smoothing=eps, reduction="none")
    want.sum().backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-12, atol=1e-12)
    grad = x.clone()
    kce.vocab_ce_grad_reference_(grad, t, m, s, torch.ones(6, dtype=torch.float64), eps / 11, 1 - eps)
    torch.testing.assert_close(grad, ref.grad, rtol=1e-12, atol=1e-12)


def _fused_ce_tp(cases):
    """On each tp rank: the fused autograd function (reference phases on CPU) on this rank's
    vocabulary slice, through vocab_parallel_cross_entropy with the dispatch a GPU would make (the
    fused path wherever the slice is not empty; an empty slice takes the torch path). Returns per
    case (loss, this rank's logit-gradient slice, whether the gradient was written in place)."""
    from shardlib.parallel import cross_entropy as pce

    mesh = shardlib.init_mesh({"tp": torch.distributed.get_world_size()})
    out = []
    original = pce._fused_applies
    pce._fused_applies = lambda flat: flat.shape[0] > 0 and flat.shape[1] > 0
    try:  # the worker process is reused by other tests: restore the dispatch afterwards
        for full, target, eps, reduction in cases:
            lo, hi = shard_range(full.shape[-1], mesh.size("tp"), mesh.index("tp"))
            leaf = full[:, lo:hi].clone().requires_grad_()
            logits = leaf * 1
            loss = pce.vocab_parallel_cross_entropy(logits, target, label_smoothing=eps, reduction="none",
                                                    vocab_size=full.shape[-1], mesh=mesh)
            (loss.sum() if reduction == "sum" else loss.mean()).backward()
            inplace = hi > lo and torch.equal(logits.detach(), leaf.grad)
            out.append((loss.detach(), leaf.grad, inplace or hi == lo))
    finally:
        pce._fused_applies = original
    return out


@pytest.mark.multiprocess
def test_fused_ce_function_on_tp2_matches_f_cross_entropy():
    """The fused path's cross-rank algebra (rescaled sums, three all-reduces, in-place gradient)
    on 2 ranks, float64 (rtol 1e-10), against F.cross_entropy on the full logits."""
    g = torch.Generator().manual_seed(5)
    cases = []
    # vocab 2 on 2 ranks: width 1; vocab 1: rank 1's slice is empty (torch path beside the fused one)
    for vocab, eps, red in ((9, 0.0, "sum"), (9, 0.1, "mean"), (2, 0.0, "sum"), (1, 0.1, "sum")):
        full = torch.randn(7, vocab, generator=g, dtype=torch.float64) * 4
        full[:, 0] += 10  # the max sits on rank 0 only: rank 1 must rescale its sum
        target = torch.randint(0, vocab, (7,), generator=g)
        target[2] = -100
        cases.append((full, target, eps, red))
    results = run_on(2, _fused_ce_tp, cases)
    for i, (full, target, eps, red) in enumerate(cases):
        ref = full.clone().requires_grad_()
        want = F.cross_entropy(ref, target, label_smoothing=eps, reduction="none")
        (want.sum() if red == "sum" else want.mean()).backward()
        grads = []
        for rank in range(2):
            loss, grad, inplace = results[rank][i]
            torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
            assert inplace
            grads.append(grad)
        torch.testing.assert_close(torch.cat(grads, dim=-1), ref.grad, rtol=1e-10, atol=1e-12)


def test_fused_ce_leaf_logits_are_not_overwritten():
    mesh = shardlib.init_mesh({"tp": 1})
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    keep = x.detach().clone()
    fused_vocab_parallel_ce(x, torch.tensor([0, 1, 4]), mesh, "tp", 0, 5, -100, 0.0).sum().backward()
    assert torch.equal(x.detach(), keep) and not torch.equal(x.grad, keep)


def test_vocab_parallel_ce_takes_torch_path_on_cpu():
    assert not kce.fused_ce_applies(torch.zeros(2, 3))
    mesh = shardlib.init_mesh({"tp": 1})
    x = torch.randn(4, 6, requires_grad=True)
    logits = x * 1
    t = torch.tensor([1, 2, -100, 5])
    vocab_parallel_cross_entropy(logits, t, mesh=mesh).backward()
    assert not torch.equal(logits.detach(), x.grad)  # nothing written in place on the torch path


# -- custom ops: fake implementations and schemas ------------------------------------------------


def test_opcheck_custom_ops():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 8, generator=g)
    w, b = torch.randn(8, generator=g), torch.randn(8, generator=g)
    y, mean, rstd = knorms.norm_forward(x, w, b, 1e-5, False)
    t = torch.tensor([0, 3, -1, 7, 2])
    m, s, _, _ = kce.vocab_ce_stats(x, t, True)
    n = 16
    cases = [
        (knorms.norm_forward, (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), 1e-5, False)),
        (knorms.norm_forward, (x, w, None, 1e-6, True)),
        (knorms.norm_backward, (torch.randn(5, 8), x.detach(), w.detach(), mean, rstd, True, False)),
        (kce.vocab_ce_stats, (x.detach(), t, True)),
        (kce.vocab_ce_grad_, (x.detach().clone(), t, m, s, torch.ones(5), 0.01, 0.9)),
        (kernels.adamw_, (torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.float16),
                          1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0)),
    ]
    for op, args in cases:  # aot dispatch: test_ops_compose_with_torch_compile
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_ops_compose_with_torch_compile():
    """fullgraph torch.compile (aot_eager: traces through the fake impls and the registered
    autograd, no C++ build) gives the eager values and gradients."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 3, 8, generator=g, requires_grad=True)
    w = torch.randn(8, generator=g, requires_grad=True)
    t = torch.tensor([1, 0, 7, 3])

    def f(x, w):
        y = kernels.layer_norm(x, 8, w, None) + kernels.rms_norm(x, 8, w, eps=1e-6)
        m, s, xt, _ = kernels.vocab_ce_stats(y[:, 0].detach(), t, False)
        return y.square().sum() + (m + s.log() - xt).sum()

    eager = f(x, w)
    ge = torch.autograd.grad(eager, (x, w))
    comp = torch.compile(f, backend="aot_eager", fullgraph=True)(x, w)
    gc = torch.autograd.grad(comp, (x, w))
    torch.testing.assert_close(comp, eager)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_fused_adamw_calls_the_op_only_under_compile(monkeypatch):
    """FusedAdamW's eager step calls the implementation itself (the custom op's dispatch cost
    more than the update, see kernels.adamw._eager_adamw); traced by Dynamo it is the op, so
    the graph holds ``shardlib.adamw_``. Both give the values of torch.optim.AdamW."""
    from shardlib.kernels import adamw as kadamw

    calls = []
    monkeypatch.setattr(kadamw, "adamw_", lambda *a: (calls.append(1), kadamw._adamw_step(*a))[1])
    p, ref = torch.nn.Parameter(torch.arange(8.0)), torch.nn.Parameter(torch.arange(8.0))
    opt, topt = kernels.FusedAdamW([p], lr=0.1, weight_decay=0.1), torch.optim.AdamW([ref], lr=0.1, weight_decay=0.1)
    for _ in range(2):
        p.grad, ref.grad = torch.linspace(-1, 1, 8), torch.linspace(-1, 1, 8)
        opt.step()
        topt.step()
    assert calls == []  # eager: no op dispatch
    torch.testing.assert_close(p.detach(), ref.detach())
    monkeypatch.undo()

    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return gm.forward

    def args():
        return (torch.arange(16.0), torch.ones(16), torch.zeros(16), torch.zeros(16), None, 1e-2, 0.9, 0.999, 1e-8, 0.1, 1.0)

    eager, traced = args(), args()
    kadamw._eager_adamw(*eager)
    torch.compile(kadamw._eager_adamw, backend=backend, fullgraph=True)(*traced)
    assert "shardlib.adamw_.default" in seen
    for a, b in zip(eager[:4], traced[:4]):
        torch.testing.assert_close(a, b)


# -- the switch ----------------------------------------------------------------------------------


def test_switch(monkeypatch):
    assert kernels.enabled()
    with kernels.use_kernels(False):
        assert not kernels.enabled() and not kernels.use_triton(torch.zeros(1))
    assert kernels.enabled()
    assert kernels.set_enabled(False) is True and not kernels.enabled()
    kernels.set_enabled(True)
    monkeypatch.setenv("SHARDLIB_KERNELS_FORCE_TRITON", "1")
    assert kernels.use_triton(torch.zeros(1)) == kernels.HAS_TRITON
    monkeypatch.delenv("SHARDLIB_KERNELS_FORCE_TRITON")
    assert not kernels.use_triton(torch.zeros(1))  # CPU tensors: the reference


def test_env_switch_off(monkeypatch):
    monkeypatch.setenv("SHARDLIB_KERNELS", "0")
    try:
        importlib.reload(_dispatch)
        assert not _dispatch.enabled()
    finally:
        monkeypatch.delenv("SHARDLIB_KERNELS")
        importlib.reload(_dispatch)
    assert _dispatch.enabled()


def test_env_switch_typo_warns(monkeypatch):
    monkeypatch.setenv("SHARDLIB_KERNELS", "flase")
    try:
        with pytest.warns(UserWarning, match="SHARDLIB_KERNELS='flase' is not understood"):
            importlib.reload(_dispatch)
        assert _dispatch.enabled()
    finally:
        monkeypatch.delenv("SHARDLIB_KERNELS")
        importlib.reload(_dispatch)


def test_import_and_cpu_ops_never_import_triton():
    """``import shardlib`` and a GPT forward and backward on CPU do not import triton, and the
    CPU path of every op (LayerNorm, the fused cross-entropy statistics, a FusedAdamW step)
    runs its torch reference without importing the Triton programs
    (``shardlib.kernels._programs``, imported with triton on the first launch). triton was
    imported with every ``import shardlib`` (through FusedAdamW's module), 0.2-0.3 s of each
    fresh process on 2 cores, although the kernels' docstring said it never was. (Calling a
    custom op or creating any torch optimizer imports torch._dynamo, which imports triton when it
    is installed: torch's doing, so that part is not checked.)"""
    code = """
import sys
import torch
import shardlib
from shardlib.kernels import FusedAdamW, layer_norm, vocab_ce_stats
from shardlib.models import GPT, GPTConfig
model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=8))
x = torch.randint(0, 32, (2, 8))
model(x, targets=x)[1].backward()
print("triton" in sys.modules)
layer_norm(torch.randn(3, 8, requires_grad=True), 8, torch.ones(8), torch.zeros(8)).sum().backward()
vocab_ce_stats(torch.randn(3, 8), torch.tensor([0, 3, 7]), False)
FusedAdamW(model.parameters(), lr=1e-3).step()
print("shardlib.kernels._programs" in sys.modules)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SHARDLIB_KERNELS_FORCE_TRITON")}
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE.parent, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["False", "False"], proc.stdout


# -- Triton programs -----------------------------------------------------------------------------


def test_triton_kernels_in_interpreter():
    """Every Triton program in the interpreter (fp32, fp16) against its reference: see
    tests/_kernels_interpreter.py. About 25 s, most of it importing torch and triton."""
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]' installs it on Linux x86_64)")
    env = dict(os.environ, TRITON_INTERPRET="1", SHARDLIB_KERNELS_FORCE_TRITON="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "_kernels_interpreter.py")],
        cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the benchmark itself")
def test_gpu_check_script_says_it_needs_cuda(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE.parent))
    from benchmarks.kernels_gpu import main

    assert main([]) == 0
    assert "needs CUDA" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: bf16 kernels are checked on GPU only (the Triton interpreter computes bf16 "
                           "wrongly); fp32/fp16 run in the interpreter (test_triton_kernels_in_interpreter)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_kernels_on_cuda(dtype):
    pytest.importorskip("triton")
    sys.path.insert(0, str(HERE.parent))
    from benchmarks.kernels_gpu import check_correctness

    check_correctness(dtype, torch.device("cuda"))
