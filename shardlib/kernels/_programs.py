"""The Triton programs of :mod:`shardlib.kernels`, imported (with ``triton``) only when an op
runs one (:func:`~shardlib.kernels._dispatch.programs`, after
:func:`~shardlib.kernels.use_triton`), so importing an op module (``import shardlib`` imports
:class:`~shardlib.kernels.FusedAdamW`) never imports triton. Each op module holds the launch
code and the plain-torch reference its programs are tested against."""

import triton
import triton.language as tl

# -- adamw ------------------------------------------------------------------------------------------

@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, n, decay, one_minus_beta1, beta2, one_minus_beta2,
                  neg_step_size, bc2_sqrt, eps, HAS_COPY: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    p = p * decay
    m = m + one_minus_beta1 * (g - m)
    v = v * beta2 + one_minus_beta2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps  # IEEE sqrt and division, as torch's
    p = p + neg_step_size * tl.div_rn(m, denom)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_COPY:
        tl.store(c_ptr + offs, p.to(c_ptr.dtype.element_ty), mask=mask)

# -- cross_entropy ----------------------------------------------------------------------------------

@triton.jit
def _ce_stats_kernel(x_ptr, t_ptr, m_ptr, s_ptr, xt_ptr, sx_ptr, V, SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * V
    m = -float("inf")
    s = 0.0
    sx = 0.0
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        if SMOOTH:
            sx += tl.sum(tl.where(mask, x, 0.0), axis=0)
    t = tl.load(t_ptr + row)
    mine = (t >= 0) & (t < V)
    xt = tl.load(base + tl.where(mine, t, 0), mask=mine, other=0.0).to(tl.float32)
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)
    tl.store(xt_ptr + row, xt)
    tl.store(sx_ptr + row, sx)

@triton.jit
def _ce_grad_kernel(x_ptr, t_ptr, m_ptr, s_ptr, g_ptr, V, eps_over_v, one_minus_eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * V
    t = tl.load(t_ptr + row)
    m = tl.load(m_ptr + row)
    inv_s = 1.0 / tl.load(s_ptr + row)
    g = tl.load(g_ptr + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - m) * inv_s - eps_over_v - tl.where(cols == t, one_minus_eps, 0.0)
        tl.store(base + cols, (grad * g).to(x_ptr.dtype.element_ty), mask=mask)

# -- norms ------------------------------------------------------------------------------------------

@triton.jit
def _norm_fwd_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, C, eps,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    x = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    if RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=0) / C
        xc = tl.where(mask, x - mean, 0.0)
        tl.store(mean_ptr + row, mean)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(xc * xc, axis=0) / C + eps)
    tl.store(rstd_ptr + row, rstd)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * C + cols, y.to(y_ptr.dtype.element_ty), mask=mask)

@triton.jit
def _norm_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, N, C, rows_per_program,
                     HAS_W: tl.constexpr, HAS_B: tl.constexpr, RMS: tl.constexpr, BLOCK_C: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    db = tl.zeros((BLOCK_C,), dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, N)
    offs = start.to(tl.int64) * C + cols  # advanced by C per row (no 32-bit row * C product)
    for r in range(start, end):
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r)
        if RMS:
            xhat = x * rstd
        else:
            xhat = tl.where(mask, (x - tl.load(mean_ptr + r)) * rstd, 0.0)
        if HAS_W:
            wdy = w * dy
        else:
            wdy = dy
        c1 = tl.sum(xhat * wdy, axis=0) / C
        if RMS:
            dx = (wdy - xhat * c1) * rstd
        else:
            dx = (wdy - (xhat * c1 + tl.sum(wdy, axis=0) / C)) * rstd
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
        offs += C
    if HAS_W:
        tl.store(dw_ptr + pid * C + cols, dw, mask=mask)
    if HAS_B:
        tl.store(db_ptr + pid * C + cols, db, mask=mask)
