"""The backward of the functional AttnRes op (``k3fusion::attn_res``) in two launches.

The gradients of ``k3fusion.reference.attn_res`` (prefix update, softmax mix, output
norm) in fp32, from the sources, the weights and the incoming gradients; the forward
saves nothing. Both kernels read a token's sources a whole row at a time, one source
per step of a software-pipelined loop (as the forward's prefill shape does). The
**scalars** kernel (one program per token) computes its softmax weights, the gradient
reaching its mix and the coefficients of its sources' gradients; the **rows** kernel
(one program per group of tokens) writes the sources' gradients and sums the weight
gradients over its tokens in registers, one row per group summed after (no atomics: the
same bits on every run).
The formulas and both kernels' designs: docs/design-notes.md, "kernels/attn_res_backward.py".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, check_launchable, num_sms

__all__ = ["attn_res_backward", "LOOP_STAGES", "GROUPS_PER_SM"]

#: Source rows in flight in each kernel's pipelined source loop (the forward's prefill
#: shape's depth: docs/experiments.md, "2026-11-29: the pipelined source loop").
LOOP_STAGES = 3
#: Token groups of the rows kernel per SM (fewer programs, each summing its weight
#: gradients over more tokens); not swept: docs/experiments.md, "2026-12-03: the fused backward".
GROUPS_PER_SM = 2


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
def _bank_row(blocks_row, s, blocks_block_stride, cols, cmask):
    row = (tl.zeros([], tl.int64) + s) * blocks_block_stride  # int64: a stacked bank's
    return tl.load(blocks_row + row + cols, mask=cmask, other=0.0).to(tl.float32)  # stride is T*H


@triton.jit
def _pick(vec, srcs, s):
    """``vec[s]`` of a small ``[S]`` vector (a register select, not a memory access)."""
    return tl.sum(tl.where(srcs == s, vec, 0.0), axis=0)


@triton.jit
def _attn_res_bwd_scalars_kernel(
    prefix_ptr, prefix_stride, delta_ptr, delta_stride,
    blocks_ptr, blocks_token_stride, blocks_block_stride,
    norm_w_ptr, proj_w_ptr, out_norm_w_ptr,
    grad_ptr, grad_stride,
    coef_ptr, norm_ptr, dm_ptr, x_ptr,
    H, eps, out_eps,
    BLOCK_H: tl.constexpr, S: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    HAS_DELTA: tl.constexpr, HAS_OUT_NORM: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """One program per token: softmax weights, the gradient reaching the mix (stored with
    the output norm, with the rounded mix), and each source's ``w``, ``a``, ``b``."""
    tok = tl.program_id(0).to(tl.int64)  # int64: token * stride overflows int32
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    srcs = tl.arange(0, S)
    blocks_row = blocks_ptr + tok * blocks_token_stride
    prefix_row = prefix_ptr + tok * prefix_stride
    delta_row = delta_ptr + tok * delta_stride
    dtype = prefix_ptr.dtype.element_ty
    g = (tl.load(norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
         * tl.load(proj_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32))
    # The gradient reaching the normalized mix (the mix itself without the output norm).
    dxh = tl.load(grad_ptr + tok * grad_stride + cols, mask=cmask, other=0.0).to(tl.float32)
    if HAS_OUT_NORM:
        dxh = dxh * tl.load(out_norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)

    # Pass 1, an online softmax as the forward's: per source its 1/rms, its dot with g
    # and with dxh, and the running mix. The last source (in registers) seeds it.
    v = _last_source(prefix_row, delta_row, cols, cmask, HAS_DELTA)
    here = srcs == NUM_BLOCKS
    r_s = tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
    c_s = tl.sum(v * g, axis=0)
    r = tl.where(here, r_s, 0.0)
    c = tl.where(here, c_s, 0.0)
    dots = tl.where(here, tl.sum(dxh * v, axis=0), 0.0)
    m = r_s * c_s
    den = tl.full([], 1.0, tl.float32)
    acc = v
    for s in tl.range(0, NUM_BLOCKS, num_stages=LOOP_STAGES):
        v = _bank_row(blocks_row, s, blocks_block_stride, cols, cmask)
        here = srcs == s
        r_s = tl.rsqrt(tl.sum(v * v, axis=0) / H + eps)
        c_s = tl.sum(v * g, axis=0)
        r = tl.where(here, r_s, r)
        c = tl.where(here, c_s, c)
        dots = tl.where(here, tl.sum(dxh * v, axis=0), dots)
        m_new = tl.maximum(m, r_s * c_s)
        scale = tl.exp(m - m_new)
        e = tl.exp(r_s * c_s - m_new)
        den = den * scale + e
        acc = acc * scale + e * v
        m = m_new
    w = tl.where(srcs <= NUM_BLOCKS, tl.exp(r * c - m) / den, 0.0)

    dw = dots  # sum(dm * v_s) where dm, the mix's gradient, is dxh without the norm
    if HAS_OUT_NORM:
        # The mix rounded as the forward rounded it; its norm's backward gives
        # dm = rho dxh - k x, so dw_s = rho sum(dxh v_s) - k sum(x v_s).
        x = (acc / den).to(dtype).to(tl.float32)
        rho = tl.rsqrt(tl.sum(x * x, axis=0) / H + out_eps)
        k = rho * rho * rho * tl.sum(dxh * x, axis=0) / H
        # Stored in the model dtype, as autograd holds the mix's gradient.
        tl.store(dm_ptr + tok * H + cols, (rho * dxh - k * x).to(dm_ptr.dtype.element_ty),
                 mask=cmask)
        tl.store(x_ptr + tok * H + cols, x.to(x_ptr.dtype.element_ty), mask=cmask)
        tl.store(norm_ptr + tok, rho)
        # Pass 2: sum(x v_s) (mostly from L2: the token's rows were just read).
        v = _last_source(prefix_row, delta_row, cols, cmask, HAS_DELTA)
        xv = tl.where(srcs == NUM_BLOCKS, tl.sum(x * v, axis=0), 0.0)
        for s in tl.range(0, NUM_BLOCKS, num_stages=LOOP_STAGES):
            v = _bank_row(blocks_row, s, blocks_block_stride, cols, cmask)
            xv = tl.where(srcs == s, tl.sum(x * v, axis=0), xv)
        dw = rho * dots - k * xv
    dlogit = w * (dw - tl.sum(w * dw, axis=0))
    coef_row = coef_ptr + tok * (3 * S)
    tl.store(coef_row + srcs, w)
    tl.store(coef_row + S + srcs, dlogit * r)
    tl.store(coef_row + 2 * S + srcs, dlogit * c * r * r * r / H)


@triton.jit
def _attn_res_bwd_rows_kernel(
    prefix_ptr, prefix_stride, delta_ptr, delta_stride,
    blocks_ptr, blocks_token_stride, blocks_block_stride,
    norm_w_ptr, proj_w_ptr,
    grad_ptr, grad_stride, grad_prefix_ptr, grad_prefix_stride,
    coef_ptr, norm_ptr, dm_ptr, dm_stride, x_ptr,
    d_blocks_ptr, d_blocks_token_stride, d_blocks_block_stride,
    d_last_ptr, d_last_stride,
    u_part_ptr, w_out_part_ptr,
    T, H, tokens_per_group,
    BLOCK_H: tl.constexpr, S: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    HAS_DELTA: tl.constexpr, HAS_GRAD_PREFIX: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr, OUT_WEIGHT_IN_FP32: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """One program per group of tokens: the sources' gradients, and the group's sums of
    ``u`` and of the output norm's weight gradient."""
    group = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    srcs = tl.arange(0, S)
    dtype = prefix_ptr.dtype.element_ty
    g = (tl.load(norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
         * tl.load(proj_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32))
    u = tl.zeros([BLOCK_H], tl.float32)
    w_out_grad = tl.zeros([BLOCK_H], tl.float32)
    first = group * tokens_per_group
    for i in range(0, tl.minimum(tokens_per_group, T - first)):
        tok = first + i
        coef_row = coef_ptr + tok * (3 * S)
        w = tl.load(coef_row + srcs)
        a = tl.load(coef_row + S + srcs)
        b = tl.load(coef_row + 2 * S + srcs)
        dm = tl.load(dm_ptr + tok * dm_stride + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_OUT_NORM:
            gr = tl.load(grad_ptr + tok * grad_stride + cols, mask=cmask, other=0.0)
            xn = tl.load(x_ptr + tok * H + cols, mask=cmask, other=0.0).to(tl.float32)
            xn = xn * tl.load(norm_ptr + tok)
            if not OUT_WEIGHT_IN_FP32:
                xn = xn.to(dtype).to(tl.float32)  # the forward rounded it before weighting
            w_out_grad += gr.to(tl.float32) * xn
        blocks_row = blocks_ptr + tok * blocks_token_stride
        d_row = d_blocks_ptr + tok * d_blocks_token_stride
        for s in tl.range(0, NUM_BLOCKS, num_stages=LOOP_STAGES):
            v = _bank_row(blocks_row, s, blocks_block_stride, cols, cmask)
            a_s = _pick(a, srcs, s)
            dv = _pick(w, srcs, s) * dm + a_s * g - _pick(b, srcs, s) * v
            u += a_s * v
            tl.store(d_row + (tl.zeros([], tl.int64) + s) * d_blocks_block_stride + cols,
                     dv.to(d_blocks_ptr.dtype.element_ty), mask=cmask)
        v = _last_source(prefix_ptr + tok * prefix_stride, delta_ptr + tok * delta_stride,
                         cols, cmask, HAS_DELTA)
        a_s = _pick(a, srcs, NUM_BLOCKS)
        dv = _pick(w, srcs, NUM_BLOCKS) * dm + a_s * g - _pick(b, srcs, NUM_BLOCKS) * v
        u += a_s * v
        if HAS_GRAD_PREFIX:  # the new prefix's own gradient
            dv += tl.load(grad_prefix_ptr + tok * grad_prefix_stride + cols, mask=cmask,
                          other=0.0).to(tl.float32)
        tl.store(d_last_ptr + tok * d_last_stride + cols, dv.to(d_last_ptr.dtype.element_ty),
                 mask=cmask)
    tl.store(u_part_ptr + group * H + cols, u, mask=cmask)
    if HAS_OUT_NORM:
        tl.store(w_out_part_ptr + group * H + cols, w_out_grad, mask=cmask)


def _groups(T: int, device: torch.device) -> int:
    return max(min(T, GROUPS_PER_SM * num_sms(device)), 1)


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
    token_groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of the functional AttnRes on row views, from the incoming ``grad_out``
    ``[T, H]`` (and ``grad_new_prefix``, the new prefix's, with ``delta``).

    ``prefix``, ``delta`` ``[T, H]``, ``blocks [T, NBmax, H]``: any row strides, last dim
    contiguous. Returns ``(d_last, d_blocks, d_norm_w, d_proj_w, d_out_norm_w)``:
    ``d_last [T, H]`` is the gradient of the last source (the prefix's, and ``delta``'s),
    ``d_blocks [T, NBmax, H]`` is 0 past ``num_blocks``; weight gradients in their
    weights' dtypes (``None`` without ``out_norm_w``). ``token_groups`` (tests): the rows
    kernel's programs (default :data:`GROUPS_PER_SM` per SM, at most ``T``). Arguments are
    validated by the caller (``k3fusion.ops``).
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
    groups = token_groups if token_groups is not None else _groups(T, device)
    if groups < 1:
        raise ValueError(f"token_groups must be >= 1, got {groups}")
    u_part = torch.zeros((groups, H), dtype=torch.float32, device=device)
    w_out_part = torch.zeros((groups, H) if has_norm else (1,), dtype=torch.float32,
                             device=device)
    if T > 0:
        S = triton.next_power_of_2(num_blocks + 1)
        block_h = triton.next_power_of_2(H)
        num_warps = 8 if block_h >= 4096 else 4
        coef = torch.empty((T, 3 * S), dtype=torch.float32, device=device)
        norm = torch.empty((T,) if has_norm else (1,), dtype=torch.float32, device=device)
        # With the output norm the scalars kernel stores the mix's gradient and the mix;
        # without it the mix's gradient is the incoming one.
        dm = torch.empty((T, H), dtype=prefix.dtype, device=device) if has_norm else grad_out
        x = torch.empty((T, H), dtype=prefix.dtype, device=device) if has_norm else prefix
        has_delta = delta is not None
        delta_arg = delta if has_delta else prefix
        sources = (prefix, prefix.stride(0), delta_arg, delta_arg.stride(0),
                   blocks, blocks.stride(0), blocks.stride(1))
        flags = dict(BLOCK_H=block_h, S=S, NUM_BLOCKS=int(num_blocks), HAS_DELTA=has_delta,
                     HAS_OUT_NORM=has_norm, LOOP_STAGES=LOOP_STAGES, num_warps=num_warps)
        _attn_res_bwd_scalars_kernel[(T,)](
            *sources, norm_w, proj_w, out_norm_w if has_norm else norm_w,
            grad_out, grad_out.stride(0), coef, norm, dm, x, H, float(eps), float(out_eps),
            **flags)
        has_gp = grad_new_prefix is not None
        gp = grad_new_prefix if has_gp else grad_out
        _attn_res_bwd_rows_kernel[(groups,)](
            *sources, norm_w, proj_w, grad_out, grad_out.stride(0), gp, gp.stride(0),
            coef, norm, dm, dm.stride(0), x,
            d_blocks, d_blocks.stride(0), d_blocks.stride(1), d_last, d_last.stride(0),
            u_part, w_out_part, T, H, cdiv(T, groups),
            HAS_GRAD_PREFIX=has_gp, OUT_WEIGHT_IN_FP32=bool(out_weight_in_fp32), **flags)
    u = u_part.sum(0)
    d_norm_w = (u * proj_w.float()).to(norm_w.dtype)
    d_proj_w = (u * norm_w.float()).to(proj_w.dtype)
    d_out_norm_w = w_out_part.sum(0).to(out_norm_w.dtype) if has_norm else None
    return d_last, d_blocks, d_norm_w, d_proj_w, d_out_norm_w
