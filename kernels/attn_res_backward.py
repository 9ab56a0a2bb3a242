"""The backward of the functional AttnRes op (``k3fusion::attn_res``) in two launches.

The gradients of ``k3fusion.reference.attn_res`` (prefix update, softmax mix, output
norm) in fp32, from the sources, the weights and the incoming gradients; the forward
saves nothing. The **scalars** kernel (one program per token, two passes over its
sources) computes each token's softmax weights and the coefficients of its sources'
gradients; the **rows** kernel (token groups x column chunks) reads the sources once
more, writes their gradients and sums the weight gradients over its tokens in
registers, one row per group summed after (no atomics: the same bits on every run).
The formulas and both kernels' designs: docs/design-notes.md, "kernels/attn_res_backward.py".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, check_launchable

__all__ = ["attn_res_backward", "SCALARS_TILE", "ROWS_BLOCK_H", "ROWS_TOKENS"]

#: Elements of the scalars kernel's source tile ([sources, columns]).
SCALARS_TILE = 4096
#: Columns per program of the rows kernel ...
ROWS_BLOCK_H = 256
#: ... and tokens per program (its weight-gradient rows are summed over these).
ROWS_TOKENS = 32


@triton.jit
def _last_source(prefix_row, delta_row, cols, cmask, HAS_DELTA: tl.constexpr):
    """The last source: the prefix, or ``prefix + delta`` rounded to the prefix dtype (as
    the forward computed it), in fp32."""
    p = tl.load(prefix_row + cols, mask=cmask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_row + cols, mask=cmask, other=0.0)
        p = (p.to(tl.float32) + d.to(tl.float32)).to(prefix_row.dtype.element_ty)
    return p.to(tl.float32)


@triton.jit
def _source_tile(blocks_row, blocks_block_stride, prefix_row, delta_row, s, cols, cmask,
                 NUM_BLOCKS: tl.constexpr, HAS_DELTA: tl.constexpr):
    """``[S, len(cols)]`` fp32: rows ``< NUM_BLOCKS`` from the bank, row ``NUM_BLOCKS``
    the last source, rows past it 0."""
    x = tl.load(blocks_row + s.to(tl.int64)[:, None] * blocks_block_stride + cols[None, :],
                mask=(s < NUM_BLOCKS)[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    p = _last_source(prefix_row, delta_row, cols, cmask, HAS_DELTA)
    return tl.where((s == NUM_BLOCKS)[:, None], p[None, :], x)


@triton.jit
def _d_mixed_hat(grad_row, out_norm_w_ptr, cols, cmask, HAS_OUT_NORM: tl.constexpr):
    """The gradient reaching the normalized mix (the incoming gradient without a norm)."""
    gr = tl.load(grad_row + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_OUT_NORM:
        gr = gr * tl.load(out_norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    return gr


@triton.jit
def _attn_res_bwd_scalars_kernel(
    prefix_ptr, prefix_stride, delta_ptr, delta_stride,
    blocks_ptr, blocks_token_stride, blocks_block_stride,
    norm_w_ptr, proj_w_ptr, out_norm_w_ptr,
    grad_ptr, grad_stride,
    coef_ptr, norm_ptr,
    H, eps, out_eps,
    BLOCK_H: tl.constexpr, S: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    HAS_DELTA: tl.constexpr, HAS_OUT_NORM: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S)
    live = s <= NUM_BLOCKS
    blocks_row = blocks_ptr + tok * blocks_token_stride
    prefix_row = prefix_ptr + tok * prefix_stride
    delta_row = delta_ptr + tok * delta_stride
    grad_row = grad_ptr + tok * grad_stride
    dtype = prefix_ptr.dtype.element_ty

    squares = tl.zeros([S, BLOCK_H], tl.float32)
    dots = tl.zeros([S, BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cmask = cols < H
        v = _source_tile(blocks_row, blocks_block_stride, prefix_row, delta_row, s, cols, cmask,
                         NUM_BLOCKS, HAS_DELTA)
        g = (tl.load(norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
             * tl.load(proj_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32))
        squares += v * v
        dots += v * g[None, :]
    r = tl.rsqrt(tl.sum(squares, axis=1) / H + eps)
    c = tl.sum(dots, axis=1)
    logit = tl.where(live, r * c, float("-inf"))
    e = tl.exp(logit - tl.max(logit, axis=0))
    w = e / tl.sum(e, axis=0)  # 0 on the rows past the last source

    # dw_s = sum_h dm_h v_sh; with the norm dm = rho dx^ - k x, so dw_s = rho A_s - k B_s
    # with A_s = sum(dx^ v_s), B_s = sum(x v_s): both accumulate in this one pass.
    acc_a = tl.zeros([S, BLOCK_H], tl.float32)
    acc_b = tl.zeros([S, BLOCK_H], tl.float32)
    sq_x = tl.zeros([BLOCK_H], tl.float32)
    dot_x = tl.zeros([BLOCK_H], tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cmask = cols < H
        v = _source_tile(blocks_row, blocks_block_stride, prefix_row, delta_row, s, cols, cmask,
                         NUM_BLOCKS, HAS_DELTA)
        dxh = _d_mixed_hat(grad_row, out_norm_w_ptr, cols, cmask, HAS_OUT_NORM)
        acc_a += v * dxh[None, :]
        if HAS_OUT_NORM:
            x = tl.sum(w[:, None] * v, axis=0).to(dtype).to(tl.float32)
            acc_b += v * x[None, :]
            sq_x += x * x
            dot_x += dxh * x
    dw = tl.sum(acc_a, axis=1)
    rho = 0.0
    k = 0.0
    if HAS_OUT_NORM:
        rho = tl.rsqrt(tl.sum(sq_x, axis=0) / H + out_eps)
        k = rho * rho * rho * tl.sum(dot_x, axis=0) / H
        dw = rho * dw - k * tl.sum(acc_b, axis=1)
    dlogit = w * (dw - tl.sum(w * dw, axis=0))
    a = dlogit * r
    b = dlogit * c * r * r * r / H
    coef_row = coef_ptr + tok * (3 * S)
    tl.store(coef_row + s, w)
    tl.store(coef_row + S + s, a)
    tl.store(coef_row + 2 * S + s, b)
    if HAS_OUT_NORM:
        tl.store(norm_ptr + tok * 2, rho)
        tl.store(norm_ptr + tok * 2 + 1, k)


@triton.jit
def _attn_res_bwd_rows_kernel(
    prefix_ptr, prefix_stride, delta_ptr, delta_stride,
    blocks_ptr, blocks_token_stride, blocks_block_stride,
    norm_w_ptr, proj_w_ptr, out_norm_w_ptr,
    grad_ptr, grad_stride, grad_prefix_ptr, grad_prefix_stride,
    coef_ptr, norm_ptr,
    d_blocks_ptr, d_blocks_token_stride, d_blocks_block_stride,
    d_last_ptr, d_last_stride,
    u_part_ptr, w_out_part_ptr,
    T, H,
    BLOCK_H: tl.constexpr, TOKENS: tl.constexpr, S: tl.constexpr,
    NUM_BLOCKS: tl.constexpr, HAS_DELTA: tl.constexpr, HAS_GRAD_PREFIX: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr, OUT_WEIGHT_IN_FP32: tl.constexpr,
):
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cmask = cols < H
    s = tl.arange(0, S)
    dtype = prefix_ptr.dtype.element_ty
    g = (tl.load(norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
         * tl.load(proj_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32))
    u = tl.zeros([BLOCK_H], tl.float32)
    w_out_grad = tl.zeros([BLOCK_H], tl.float32)
    first = group.to(tl.int64) * TOKENS  # int64: token * stride overflows int32
    for i in range(0, tl.minimum(TOKENS, T - first)):
        tok = first + i
        v = _source_tile(blocks_ptr + tok * blocks_token_stride, blocks_block_stride,
                         prefix_ptr + tok * prefix_stride, delta_ptr + tok * delta_stride,
                         s, cols, cmask, NUM_BLOCKS, HAS_DELTA)
        coef_row = coef_ptr + tok * (3 * S)
        w = tl.load(coef_row + s)
        a = tl.load(coef_row + S + s)
        b = tl.load(coef_row + 2 * S + s)
        dm = tl.load(grad_ptr + tok * grad_stride + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_OUT_NORM:
            rho = tl.load(norm_ptr + tok * 2)
            k = tl.load(norm_ptr + tok * 2 + 1)
            x = tl.sum(w[:, None] * v, axis=0).to(dtype).to(tl.float32)
            xn = x * rho
            if not OUT_WEIGHT_IN_FP32:
                xn = xn.to(dtype).to(tl.float32)  # the forward rounded it before weighting
            w_out_grad += dm * xn
            dm = rho * dm * tl.load(out_norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) - k * x
        dv = w[:, None] * dm[None, :] + a[:, None] * g[None, :] - b[:, None] * v
        u += tl.sum(a[:, None] * v, axis=0)
        # Row NUM_BLOCKS is the last source's gradient (plus the new prefix's own).
        if HAS_GRAD_PREFIX:
            gp = tl.load(grad_prefix_ptr + tok * grad_prefix_stride + cols, mask=cmask,
                         other=0.0).to(tl.float32)
            dv = tl.where((s == NUM_BLOCKS)[:, None], dv + gp[None, :], dv)
        blk = (d_blocks_ptr + tok * d_blocks_token_stride
               + s.to(tl.int64)[:, None] * d_blocks_block_stride + cols[None, :])
        tl.store(blk, dv.to(d_blocks_ptr.dtype.element_ty),
                 mask=(s < NUM_BLOCKS)[:, None] & cmask[None, :])
        last = d_last_ptr + tok * d_last_stride + cols[None, :] + 0 * s[:, None]
        tl.store(last, dv.to(d_last_ptr.dtype.element_ty),
                 mask=(s == NUM_BLOCKS)[:, None] & cmask[None, :])
    tl.store(u_part_ptr + group.to(tl.int64) * H + cols, u, mask=cmask)
    if HAS_OUT_NORM:
        tl.store(w_out_part_ptr + group.to(tl.int64) * H + cols, w_out_grad, mask=cmask)


def attn_res_backward(
    grad_out: torch.Tensor,
    grad_new_prefix: torch.Tensor | None,
    prefix: torch.Tensor,
    blocks: torch.Tensor,
    num_blocks: int,
    norm_w: torch.Tensor,
    proj_w: torch.Tensor,
    eps: float,
    *,
    delta: torch.Tensor | None = None,
    out_norm_w: torch.Tensor | None = None,
    out_eps: float = 1e-6,
    out_weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of the functional AttnRes on row views, from the incoming ``grad_out``
    ``[T, H]`` (and ``grad_new_prefix``, the new prefix's, with ``delta``).

    ``prefix``, ``delta`` ``[T, H]``, ``blocks [T, NBmax, H]``: any row strides, last dim
    contiguous. Returns ``(d_last, d_blocks, d_norm_w, d_proj_w, d_out_norm_w)``:
    ``d_last [T, H]`` is the gradient of the last source (the prefix's, and ``delta``'s),
    ``d_blocks [T, NBmax, H]`` is 0 past ``num_blocks``; weight gradients in their
    weights' dtypes (``None`` without ``out_norm_w``). Arguments are validated by the
    caller (``k3fusion.ops``).
    """
    tensors = [grad_out, prefix, blocks, norm_w, proj_w]
    tensors += [t for t in (grad_new_prefix, delta, out_norm_w) if t is not None]
    check_launchable(*tensors)
    T, H = prefix.shape
    nb_max = blocks.shape[1]
    if not 0 <= num_blocks <= nb_max:
        raise ValueError(f"num_blocks {num_blocks} outside [0, {nb_max}]")
    device = prefix.device
    d_last = torch.empty((T, H), dtype=prefix.dtype, device=device)
    d_blocks = torch.empty((T, nb_max, H), dtype=blocks.dtype, device=device)
    if num_blocks < nb_max:
        d_blocks[:, num_blocks:].zero_()  # slots the op never read
    has_norm = out_norm_w is not None
    groups = max(cdiv(T, ROWS_TOKENS), 1)
    u_part = torch.zeros((groups, H), dtype=torch.float32, device=device)
    w_out_part = torch.zeros((groups, H) if has_norm else (1,), dtype=torch.float32,
                             device=device)
    if T > 0:
        S = triton.next_power_of_2(num_blocks + 1)
        coef = torch.empty((T, 3 * S), dtype=torch.float32, device=device)
        norm = torch.empty((T, 2) if has_norm else (1,), dtype=torch.float32, device=device)
        has_delta = delta is not None
        delta_arg = delta if has_delta else prefix
        source_args = (prefix, prefix.stride(0), delta_arg, delta_arg.stride(0),
                       blocks, blocks.stride(0), blocks.stride(1),
                       norm_w, proj_w, out_norm_w if has_norm else norm_w)
        block_h = min(max(SCALARS_TILE // S, 16), triton.next_power_of_2(H))
        _attn_res_bwd_scalars_kernel[(T,)](
            *source_args, grad_out, grad_out.stride(0), coef, norm, H, float(eps),
            float(out_eps), BLOCK_H=block_h, S=S, NUM_BLOCKS=int(num_blocks),
            HAS_DELTA=has_delta, HAS_OUT_NORM=has_norm, num_warps=8 if block_h * S >= 4096 else 4)
        has_gp = grad_new_prefix is not None
        gp = grad_new_prefix if has_gp else grad_out
        rows_h = min(ROWS_BLOCK_H, triton.next_power_of_2(H))
        _attn_res_bwd_rows_kernel[(groups, cdiv(H, rows_h))](
            *source_args, grad_out, grad_out.stride(0), gp, gp.stride(0), coef, norm,
            d_blocks, d_blocks.stride(0), d_blocks.stride(1), d_last, d_last.stride(0),
            u_part, w_out_part, T, H,
            BLOCK_H=rows_h, TOKENS=ROWS_TOKENS, S=S, NUM_BLOCKS=int(num_blocks),
            HAS_DELTA=has_delta, HAS_GRAD_PREFIX=has_gp, HAS_OUT_NORM=has_norm,
            OUT_WEIGHT_IN_FP32=bool(out_weight_in_fp32), num_warps=4)
    u = u_part.sum(0)
    d_norm_w = (u * proj_w.float()).to(norm_w.dtype)
    d_proj_w = (u * norm_w.float()).to(proj_w.dtype)
    d_out_norm_w = w_out_part.sum(0).to(out_norm_w.dtype) if has_norm else None
    return d_last, d_blocks, d_norm_w, d_proj_w, d_out_norm_w
