"""The backward of the functional AttnRes op (``k3fusion::attn_res``): one kernel and a
small finish.

The gradients of ``k3fusion.reference.attn_res`` (prefix update, softmax mix, output
norm) in fp32, from the sources, the weights and the incoming gradients; the forward
saves nothing. One program per group of tokens takes its tokens in turn, two passes over
each token's sources, a whole row per step of a software-pipelined loop (as the forward's
prefill shape): the forward's online softmax, then the sources' gradients. It sums the
weight gradients over its tokens in registers, one row per group; the finish kernel sums
those rows in a fixed order (no atomics: the same bits on every run).
The formulas and the design: docs/design-notes.md, "kernels/attn_res_backward.py".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import cdiv, check_launchable, num_sms
from .attn_res import _sum_pair

__all__ = ["attn_res_backward", "LOOP_STAGES", "GROUPS_PER_SM"]

#: Source rows in flight in the pipelined source loops (the forward's prefill shape's
#: depth: docs/experiments.md, "2026-11-29: the pipelined source loop").
LOOP_STAGES = 3
#: Token groups (programs) per SM, and warps a program at rows of 4096 columns or more
#: (4 below): docs/experiments.md, "2026-12-03: the fused backward" (the one-kernel form).
GROUPS_PER_SM = 1
NUM_WARPS = 8
#: Columns per program of the kernel that sums the groups' weight-gradient rows; each
#: program reads its columns of every group's row in one tile, up to FINISH_ROWS.
FINISH_COLUMNS = 32
FINISH_ROWS = 256


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
def _source_gradient(v, s, dm, shared, g, w, r, c, srcs, H):
    """Source ``s`` (row ``v``): ``dw_s = sum(dm v_s)``, its ``w_s``, ``w_s r_s`` and its
    row's gradient ``w_s dm + a_s g - b_s v_s``, ``a_s = dlogit_s r_s`` with ``dlogit_s =
    w_s (dw_s - shared)``, ``b_s = a_s c_s r_s^2 / H``."""
    w_s = _pick(w, srcs, s)
    r_s = _pick(r, srcs, s)
    dw_s = tl.sum(dm * v, axis=0)
    a_s = w_s * (dw_s - shared) * r_s
    b_s = a_s * _pick(c, srcs, s) * r_s * r_s / H
    return dw_s, w_s, w_s * r_s, w_s * dm + a_s * g - b_s * v


@triton.jit
def _attn_res_bwd_kernel(
    prefix_ptr, prefix_stride, delta_ptr, delta_stride,
    blocks_ptr, blocks_token_stride, blocks_block_stride,
    norm_w_ptr, proj_w_ptr, out_norm_w_ptr,
    grad_ptr, grad_stride, grad_prefix_ptr, grad_prefix_stride,
    d_blocks_ptr, d_blocks_token_stride, d_blocks_block_stride,
    d_last_ptr, d_last_stride,
    u_part_ptr, w_out_part_ptr,
    T, H, tokens_per_group, eps, out_eps,
    BLOCK_H: tl.constexpr, S: tl.constexpr, NUM_BLOCKS: tl.constexpr,
    HAS_DELTA: tl.constexpr, HAS_GRAD_PREFIX: tl.constexpr,
    HAS_OUT_NORM: tl.constexpr, OUT_WEIGHT_IN_FP32: tl.constexpr, LOOP_STAGES: tl.constexpr,
):
    """One program per group of tokens, two passes over each token's sources: the
    forward's online softmax (1/rms, logit sums, the mix), then the sources' gradients.
    Sums ``u`` and the output norm's weight gradient over the group's tokens."""
    group = tl.program_id(0).to(tl.int64)  # int64: token * stride overflows int32
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
        blocks_row = blocks_ptr + tok * blocks_token_stride
        prefix_row = prefix_ptr + tok * prefix_stride
        delta_row = delta_ptr + tok * delta_stride
        # Pass 1, the forward's online softmax: per source its 1/rms ``r`` and its dot
        # with g ``c``, and the running mix. The last source seeds it.
        v = _last_source(prefix_row, delta_row, cols, cmask, HAS_DELTA)
        c_s, sq = _sum_pair(v * g, v * v, 0)
        r_s = tl.rsqrt(sq / H + eps)
        here = srcs == NUM_BLOCKS
        r = tl.where(here, r_s, 0.0)
        c = tl.where(here, c_s, 0.0)
        m = r_s * c_s
        den = tl.full([], 1.0, tl.float32)
        acc = v
        for s in tl.range(0, NUM_BLOCKS, num_stages=LOOP_STAGES):
            v = _bank_row(blocks_row, s, blocks_block_stride, cols, cmask)
            c_s, sq = _sum_pair(v * g, v * v, 0)
            r_s = tl.rsqrt(sq / H + eps)
            here = srcs == s
            r = tl.where(here, r_s, r)
            c = tl.where(here, c_s, c)
            m_new = tl.maximum(m, r_s * c_s)
            scale = tl.exp(m - m_new)
            e = tl.exp(r_s * c_s - m_new)
            den = den * scale + e
            acc = acc * scale + e * v
            m = m_new
        w = tl.where(srcs <= NUM_BLOCKS, tl.exp(r * c - m) / den, 0.0)
        mix = acc / den
        # dm, the gradient reaching the mix; and the softmax backward's shared term
        # sum_t w_t sum(dm v_t) as sum(dm mix), without a pass over the sources.
        dm = tl.load(grad_ptr + tok * grad_stride + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_OUT_NORM:
            # The output norm read the mix rounded to the model dtype: x.
            x = mix.to(dtype).to(tl.float32)
            rho = tl.rsqrt(tl.sum(x * x, axis=0) / H + out_eps)
            xn = x * rho
            if not OUT_WEIGHT_IN_FP32:
                xn = xn.to(dtype).to(tl.float32)  # the forward rounded it before weighting
            w_out_grad += dm * xn
            dxh = dm * tl.load(out_norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
            dm = rho * dxh - (rho * rho * rho * tl.sum(dxh * x, axis=0) / H) * x
        # One source: dm v - shared is exactly 0, as the softmax's own backward gives.
        shared = tl.sum(dm * mix, axis=0)
        # Pass 2 (the token's rows mostly from L2 now): each source's gradient. The weight
        # gradients sum over every token and source, so they take the shared term as the
        # reference does, sum_s w_s dw_s of these same dw_s (``shared`` alone left them
        # up to 20 ulps off where the terms cancel): u gets w_s r_s (dw_s - shared) v_s per
        # block now -- small where the terms cancel -- and, once the sum is known, minus
        # (sum - shared) sum_s w_s r_s v_s, a rounding-sized correction. (u as
        # sum w r dw v - sum * sum w r v cancelled two large rows: 19 ulps at a draw.)
        d_row = d_blocks_ptr + tok * d_blocks_token_stride
        weighted = tl.zeros([BLOCK_H], tl.float32)
        shared_sum = tl.zeros([], tl.float32)
        for s in tl.range(0, NUM_BLOCKS, num_stages=LOOP_STAGES):
            v = _bank_row(blocks_row, s, blocks_block_stride, cols, cmask)
            dw_s, w_s, wr_s, dv = _source_gradient(v, s, dm, shared, g, w, r, c, srcs, H)
            shared_sum += w_s * dw_s
            u += (wr_s * (dw_s - shared)) * v
            weighted += wr_s * v
            tl.store(d_row + (tl.zeros([], tl.int64) + s) * d_blocks_block_stride + cols,
                     dv.to(d_blocks_ptr.dtype.element_ty), mask=cmask)
        v = _last_source(prefix_row, delta_row, cols, cmask, HAS_DELTA)
        dw_s, w_s, wr_s, dv = _source_gradient(v, NUM_BLOCKS, dm, shared, g, w, r, c, srcs,
                                               H)
        # One source: its softmax weight is constant, so u gets exactly 0. (Not from the
        # formula: the compiler may contract the logit's ``r c - m`` into an FMA, leaving
        # w_s a rounding below 1 and dw_s - w_s dw_s not 0.)
        if NUM_BLOCKS > 0:
            shared_sum += w_s * dw_s
            u += (wr_s * (dw_s - shared)) * v - (shared_sum - shared) * (weighted + wr_s * v)
        if HAS_GRAD_PREFIX:  # the new prefix's own gradient
            dv += tl.load(grad_prefix_ptr + tok * grad_prefix_stride + cols, mask=cmask,
                          other=0.0).to(tl.float32)
        tl.store(d_last_ptr + tok * d_last_stride + cols, dv.to(d_last_ptr.dtype.element_ty),
                 mask=cmask)
    tl.store(u_part_ptr + group * H + cols, u, mask=cmask)
    if HAS_OUT_NORM:
        tl.store(w_out_part_ptr + group * H + cols, w_out_grad, mask=cmask)


@triton.jit
def _attn_res_bwd_finish_kernel(
    u_part_ptr, w_out_part_ptr, norm_w_ptr, proj_w_ptr,
    d_norm_w_ptr, d_proj_w_ptr, d_out_norm_w_ptr, groups, H,
    BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, HAS_OUT_NORM: tl.constexpr,
):
    """The weight gradients from the groups' rows, summed in a fixed order: ``u`` times
    the other factor of ``g = norm_w * proj_w``, and the output norm's."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < H
    rows = tl.arange(0, BLOCK_G)
    u = tl.zeros([BLOCK_C], tl.float32)
    w_out_grad = tl.zeros([BLOCK_C], tl.float32)
    for g0 in range(0, groups, BLOCK_G):
        offs = (g0 + rows)[:, None] * H + cols[None, :]
        mask = ((g0 + rows) < groups)[:, None] & cmask[None, :]
        u += tl.sum(tl.load(u_part_ptr + offs, mask=mask, other=0.0), axis=0)
        if HAS_OUT_NORM:
            w_out_grad += tl.sum(tl.load(w_out_part_ptr + offs, mask=mask, other=0.0), axis=0)
    norm_w = tl.load(norm_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    proj_w = tl.load(proj_w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    tl.store(d_norm_w_ptr + cols, (u * proj_w).to(d_norm_w_ptr.dtype.element_ty), mask=cmask)
    tl.store(d_proj_w_ptr + cols, (u * norm_w).to(d_proj_w_ptr.dtype.element_ty), mask=cmask)
    if HAS_OUT_NORM:
        tl.store(d_out_norm_w_ptr + cols, w_out_grad.to(d_out_norm_w_ptr.dtype.element_ty),
                 mask=cmask)


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
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Gradients of the functional AttnRes on row views, from the incoming ``grad_out``
    ``[T, H]`` (and ``grad_new_prefix``, the new prefix's, with ``delta``).

    ``prefix``, ``delta`` ``[T, H]``, ``blocks [T, NBmax, H]``: any row strides, last dim
    contiguous. Returns ``(d_last, d_blocks, d_norm_w, d_proj_w, d_out_norm_w)``:
    ``d_last [T, H]`` is the gradient of the last source (the prefix's, and ``delta``'s),
    ``d_blocks [T, NBmax, H]`` is 0 past ``num_blocks``; weight gradients in their
    weights' dtypes (``None`` without ``out_norm_w``). ``token_groups`` (tests, sweeps):
    the kernel's programs (default :data:`GROUPS_PER_SM` per SM, at most ``T``);
    ``num_warps`` (sweeps): its warps. Arguments are validated by the caller
    (``k3fusion.ops``).
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
    # Every group stores its row (zeros for a group past the last token).
    groups = groups if T > 0 else 0
    u_part = torch.empty((groups, H), dtype=torch.float32, device=device)
    w_out_part = torch.empty((groups, H) if has_norm else (1,), dtype=torch.float32,
                             device=device)
    if T > 0:
        has_delta, has_gp = delta is not None, grad_new_prefix is not None
        delta_arg = delta if has_delta else prefix
        gp = grad_new_prefix if has_gp else grad_out
        block_h = triton.next_power_of_2(H)
        _attn_res_bwd_kernel[(groups,)](
            prefix, prefix.stride(0), delta_arg, delta_arg.stride(0),
            blocks, blocks.stride(0), blocks.stride(1),
            norm_w, proj_w, out_norm_w if has_norm else norm_w,
            grad_out, grad_out.stride(0), gp, gp.stride(0),
            d_blocks, d_blocks.stride(0), d_blocks.stride(1), d_last, d_last.stride(0),
            u_part, w_out_part, T, H, cdiv(T, groups), float(eps), float(out_eps),
            BLOCK_H=block_h, S=triton.next_power_of_2(num_blocks + 1),
            NUM_BLOCKS=int(num_blocks), HAS_DELTA=has_delta, HAS_GRAD_PREFIX=has_gp,
            HAS_OUT_NORM=has_norm, OUT_WEIGHT_IN_FP32=bool(out_weight_in_fp32),
            LOOP_STAGES=LOOP_STAGES,
            num_warps=num_warps or (NUM_WARPS if block_h >= 4096 else 4))
    d_norm_w = torch.empty(norm_w.shape, dtype=norm_w.dtype, device=device)
    d_proj_w = torch.empty(proj_w.shape, dtype=proj_w.dtype, device=device)
    d_out_norm_w = (torch.empty(out_norm_w.shape, dtype=out_norm_w.dtype, device=device)
                    if has_norm else None)
    _attn_res_bwd_finish_kernel[(cdiv(H, FINISH_COLUMNS),)](
        u_part, w_out_part, norm_w, proj_w, d_norm_w, d_proj_w,
        d_out_norm_w if has_norm else d_norm_w, groups, H,
        BLOCK_G=min(triton.next_power_of_2(max(groups, 1)), FINISH_ROWS),
        BLOCK_C=FINISH_COLUMNS, HAS_OUT_NORM=has_norm, num_warps=8)
    return d_last, d_blocks, d_norm_w, d_proj_w, d_out_norm_w
