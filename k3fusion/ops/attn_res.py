"""``k3fusion::attn_res_`` (in place, the spec) and ``k3fusion::attn_res`` (functional, what the
graph pass inserts): the Block AttnRes step in one launch."""

from __future__ import annotations

from typing import Optional

import torch

from .. import kernels, reference
from ..kernels._launch import byte_span, may_overlap, spans_meet
from ._args import (check_eps, check_eps_tensor, eps_value, new_norm_output, as_rows,
                    runs_kernel, check_rms_norm_args)
from ._backward import differentiate_by_reference

# ====================================================================== AttnRes
#
# ``attn_res_`` is the spec (``k3fusion.reference.attn_res``): it updates ``prefix`` and
# writes ``blocks[:, block_write_idx]`` in place, as a model's decode step does.
# ``attn_res`` is its functional form, what the graph passes insert: it never mutates
# its inputs and returns the updated prefix as a new tensor instead.

__all__ = ["attn_res_", "attn_res", "check_attn_res_args"]


def _check_int(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def _check_like_prefix(t: torch.Tensor, prefix: torch.Tensor, name: str) -> None:
    """dtype, device and contiguous last dim of a tensor read or written like ``prefix``."""
    if t.dtype != prefix.dtype:
        raise TypeError(f"{name} must have prefix's dtype {prefix.dtype}, got {t.dtype}")
    if t.device != prefix.device:
        raise ValueError(f"{name} is on {t.device} but prefix is on {prefix.device}")
    if not reference.last_dim_contiguous(t):
        raise ValueError(
            f"{name} must be contiguous in its last dim (stride 1), got stride {t.stride(-1)}"
        )


def check_attn_res_args(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta=None,
                        block_write_idx=-1, out_norm_w=None, out_eps=1e-6) -> None:
    """Validate AttnRes arguments; raise TypeError/ValueError naming the argument.

    ``prefix [..., H]``; ``blocks [..., NBmax, H]`` with the same leading dims and dtype;
    ``0 <= num_blocks <= NBmax``; ``block_write_idx`` -1 (no write) or an append slot in
    ``[num_blocks, NBmax)`` (never a live source); ``delta`` like ``prefix``; weights 1-D
    ``[H]`` of fp32/bf16/fp16; one device; contiguous last dims; finite eps >= 0.
    """
    check_rms_norm_args(prefix, norm_w, eps, x_name="prefix", w_name="norm_w", eps_name="eps")
    check_rms_norm_args(prefix, proj_w, eps, x_name="prefix", w_name="proj_w", eps_name="eps")
    if out_norm_w is not None:
        check_rms_norm_args(prefix, out_norm_w, out_eps, x_name="prefix", w_name="out_norm_w",
                            eps_name="out_eps")
    else:
        check_eps(out_eps, "out_eps")
    if not isinstance(blocks, torch.Tensor):
        raise TypeError(f"blocks must be a Tensor, got {type(blocks).__name__}")
    if blocks.dim() != prefix.dim() + 1:
        raise ValueError(f"blocks must be [..., NBmax, H] with prefix's leading dims: prefix is "
                         f"{tuple(prefix.shape)}, blocks {tuple(blocks.shape)}")
    if blocks.shape[-1] != prefix.shape[-1]:
        raise ValueError(f"blocks rows are {blocks.shape[-1]} wide but prefix rows are "
                         f"{prefix.shape[-1]} wide")
    if tuple(blocks.shape[:-2]) != tuple(prefix.shape[:-1]):
        raise ValueError(f"blocks leading dims {tuple(blocks.shape[:-2])} differ from prefix "
                         f"leading dims {tuple(prefix.shape[:-1])}")
    _check_like_prefix(blocks, prefix, "blocks")
    nb_max = blocks.shape[-2]
    _check_int(num_blocks, "num_blocks")
    if not 0 <= num_blocks <= nb_max:
        raise ValueError(f"num_blocks must be in [0, NBmax={nb_max}], got {num_blocks}")
    _check_int(block_write_idx, "block_write_idx")
    if block_write_idx != -1:
        if 0 <= block_write_idx < num_blocks:
            raise ValueError(f"block_write_idx {block_write_idx} would overwrite a live source "
                             f"(num_blocks={num_blocks}); a block is appended at an index "
                             f">= num_blocks")
        if not num_blocks <= block_write_idx < nb_max:
            raise ValueError(f"block_write_idx must be -1 (no write) or in [num_blocks, NBmax) "
                             f"= [{num_blocks}, {nb_max}), got {block_write_idx}")
    if delta is not None:
        if not isinstance(delta, torch.Tensor):
            raise TypeError(f"delta must be a Tensor, got {type(delta).__name__}")
        if tuple(delta.shape) != tuple(prefix.shape):
            raise ValueError(f"delta has shape {tuple(delta.shape)} but prefix has "
                             f"{tuple(prefix.shape)}")
        _check_like_prefix(delta, prefix, "delta")


def _num_rows(prefix: torch.Tensor):
    t = 1
    for d in prefix.shape[:-1]:
        t = t * d
    return t


def _check_rows_disjoint(rows: torch.Tensor, name: str) -> None:
    """Rows the kernel writes must not share memory (an expanded tensor's would race)."""
    if rows.shape[0] > 1 and rows.numel() and abs(rows.stride(0)) < rows.shape[-1]:
        raise ValueError(f"{name} rows overlap in memory (row stride {rows.stride(0)} < "
                         f"width {rows.shape[-1]}): the in-place write would race")


def _written_rows(prefix: torch.Tensor) -> torch.Tensor:
    """``prefix`` as ``[T, H]`` *without* a copy: the in-place op writes through it."""
    try:
        rows = prefix.view(_num_rows(prefix), prefix.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"prefix with shape {tuple(prefix.shape)} and strides {prefix.stride()} cannot be "
            "viewed as [T, H] rows without a copy, and a copy would lose the in-place update "
            "(pass a tensor whose leading dims can be merged, or use k3fusion::attn_res)"
        ) from None
    _check_rows_disjoint(rows, "prefix")
    return rows


def _block_rows(blocks: torch.Tensor, num_rows, written: bool) -> torch.Tensor:
    """``blocks`` as ``[T, NBmax, H]``; without a copy when the op writes into it."""
    shape = (num_rows, blocks.shape[-2], blocks.shape[-1])
    try:
        blocks3 = blocks.view(shape)
    except RuntimeError:
        if not written:
            return blocks.reshape(shape)
        raise ValueError(
            f"blocks with shape {tuple(blocks.shape)} and strides {blocks.stride()} cannot be "
            "viewed as [T, NBmax, H] without a copy, and a copy would lose the block write "
            "(pass a bank whose leading dims can be merged, or use k3fusion::attn_res)"
        ) from None
    if written:
        _check_rows_disjoint(blocks3[:, 0], "blocks")  # the written slot's rows
    return blocks3


def _attn_res_out(prefix: torch.Tensor, out_norm_w, out_weight_in_fp32: bool) -> torch.Tensor:
    if out_norm_w is None:
        return torch.empty_like(prefix, memory_format=torch.contiguous_format)
    return new_norm_output(prefix, out_norm_w, out_weight_in_fp32)


def _attn_res_launch(prefix2, blocks3, num_blocks, norm_w, proj_w, eps, out, delta, prefix_out,
                     block_write_idx, out_norm_w, out_eps, out_weight_in_fp32) -> None:
    # The launcher is looked up per call: tests swap in a spy (tests/_kernel_paths.py).
    kernels.attn_res.attn_res(
        prefix2, blocks3, num_blocks, norm_w, proj_w, eps, as_rows(out),
        delta=None if delta is None else as_rows(delta), prefix_out=prefix_out,
        block_write_idx=block_write_idx, out_norm_w=out_norm_w, out_eps=out_eps,
        out_weight_in_fp32=out_weight_in_fp32)


# ---------------------------------------------------------------- in place: the spec


@torch.library.custom_op("k3fusion::attn_res_", mutates_args=("prefix", "blocks"))
def attn_res_inplace_op(
    prefix: torch.Tensor,
    blocks: torch.Tensor,
    num_blocks: int,
    norm_w: torch.Tensor,
    proj_w: torch.Tensor,
    eps: float,
    delta: Optional[torch.Tensor] = None,
    block_write_idx: int = -1,
    out_norm_w: Optional[torch.Tensor] = None,
    out_eps: float = 1e-6,
    out_weight_in_fp32: bool = False,
) -> torch.Tensor:
    """AttnRes, in place; see ``k3fusion.reference.attn_res``.

    With ``delta``, ``prefix`` becomes ``(prefix + delta).to(prefix.dtype)``; with
    ``block_write_idx >= 0`` that row is written to ``blocks[..., block_write_idx, :]``.
    Returns the mix (optionally output-normed) as a new tensor. A tensor the op writes
    must be viewable as rows (``[T, H]`` / ``[T, NBmax, H]``) without a copy.

    Arguments may share memory (``prefix`` a view of a bank slot, ``delta`` overlapping
    ``prefix``): the result is then the spec's, whose steps each read before they write
    -- the op detects possible overlap from addresses and strides (host-side) and runs
    the writes as separate ops before the fused mix. ``k3fusion.ops.attn_res_`` and
    ``k3fusion.eager.attn_res`` refuse a written tensor that requires grad (grad mode
    on) with a RuntimeError, as torch refuses in-place ops on leaves: the op has no
    backward.
    """
    raise NotImplementedError(f"k3fusion::attn_res_ has no kernel for {prefix.device.type}")


def _inplace_views(prefix, blocks, delta, block_write_idx):
    prefix2 = _written_rows(prefix) if delta is not None else as_rows(prefix)
    return prefix2, _block_rows(blocks, prefix2.shape[0], block_write_idx >= 0)


@attn_res_inplace_op.register_fake
def _(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta=None, block_write_idx=-1,
      out_norm_w=None, out_eps=1e-6, out_weight_in_fp32=False):
    check_attn_res_args(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta,
                        block_write_idx, out_norm_w, out_eps)
    _inplace_views(prefix, blocks, delta, block_write_idx)
    return _attn_res_out(prefix, out_norm_w, out_weight_in_fp32)


def _check_no_grad_writes(prefix, blocks, delta, block_write_idx) -> None:
    """As torch refuses in-place ops on tensors autograd needs: the op has no backward.
    (Checked in the Python entry points: inside the op, autograd's wrapper has turned
    grad mode off.)"""
    if not torch.is_grad_enabled():
        return
    for name, t, written in (("prefix", prefix, delta is not None),
                             ("blocks", blocks, block_write_idx >= 0)):
        if written and t.requires_grad:
            kind = "a leaf Variable" if t.is_leaf else "a tensor"
            raise RuntimeError(
                f"k3fusion::attn_res_ writes {name} in place, but {name} is {kind} that "
                "requires grad and the op has no backward; run it under torch.no_grad() "
                "(or use k3fusion.reference.attn_res, which autograd can differentiate)")


def _no_internal_overlap(t: torch.Tensor) -> bool:
    """Sufficient: each stride (ascending) exceeds the extent of the smaller ones."""
    extent = 0
    for st, n in sorted((abs(st), n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st <= extent:
            return False
        extent += st * (n - 1)
    return True


def _write_hazard(prefix, blocks, delta, block_write_idx) -> bool:
    """May a write of the fused launch (prefix with ``delta``, the block slot) land on
    memory the launch also reads (prefix, delta, the live sources)? The kernel reads
    and writes in one pass, so any shared byte could be read after it was written."""
    if delta is not None and (may_overlap(prefix, delta) or may_overlap(prefix, blocks)):
        return True
    if block_write_idx >= 0:
        slot = byte_span(blocks, blocks.dim() - 2, block_write_idx)
        if spans_meet(slot, byte_span(prefix)) or (
                delta is not None and spans_meet(slot, byte_span(delta))):
            return True
        if not _no_internal_overlap(blocks):  # the slot may share memory with a source
            return True
    return False


def _write_in_spec_order(prefix, prefix2, blocks, delta, block_write_idx) -> None:
    """Steps 1 and 2 of ``k3fusion.reference.attn_res`` as separate ops, each reading
    all its input before it writes (what the spec's sequential steps mean)."""
    if delta is not None:
        prefix2.copy_((prefix2.float() + as_rows(delta).float()).to(prefix2.dtype))
    if block_write_idx >= 0:
        slot = blocks[..., block_write_idx, :]
        slot.copy_(prefix.clone() if may_overlap(slot, prefix) else prefix)


@attn_res_inplace_op.register_kernel(("cpu", "cuda"))
def _(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta=None, block_write_idx=-1,
      out_norm_w=None, out_eps=1e-6, out_weight_in_fp32=False):
    check_attn_res_args(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta,
                        block_write_idx, out_norm_w, out_eps)
    prefix2, blocks3 = _inplace_views(prefix, blocks, delta, block_write_idx)
    if _write_hazard(prefix, blocks, delta, block_write_idx):
        # Aliased arguments: do the writes first, in the spec's order; the mix then only
        # reads (and sees the written values, as the spec's later steps do).
        _write_in_spec_order(prefix, prefix2, blocks, delta, block_write_idx)
        delta, block_write_idx = None, -1
        prefix2 = as_rows(prefix)
        blocks3 = _block_rows(blocks, prefix2.shape[0], written=False)
    if runs_kernel(prefix):
        out = _attn_res_out(prefix, out_norm_w, out_weight_in_fp32)
        _attn_res_launch(prefix2, blocks3, num_blocks, norm_w, proj_w, eps, out, delta, prefix2,
                         block_write_idx, out_norm_w, out_eps, out_weight_in_fp32)
        return out
    out = reference.attn_res(prefix2, blocks3, num_blocks, norm_w, proj_w, eps,
                             None if delta is None else as_rows(delta), block_write_idx,
                             out_norm_w, out_eps, out_weight_in_fp32)
    return out.reshape(prefix.shape).contiguous()


# ---------------------------------------------------------------- functional


@torch.library.custom_op("k3fusion::attn_res", mutates_args=())
def attn_res_op(
    prefix: torch.Tensor,
    blocks: torch.Tensor,
    num_blocks: int,
    norm_w: torch.Tensor,
    proj_w: torch.Tensor,
    eps: float,
    delta: Optional[torch.Tensor] = None,
    out_norm_w: Optional[torch.Tensor] = None,
    out_eps: float = 1e-6,
    out_weight_in_fp32: bool = False,
    eps_tensor: Optional[torch.Tensor] = None,
    out_eps_tensor: Optional[torch.Tensor] = None,
) -> list[torch.Tensor]:
    """AttnRes without side effects (no block write): ``[out]``, or ``[out, new_prefix]``
    with ``delta``, where ``new_prefix = (prefix + delta).to(prefix.dtype)`` is a new
    tensor and the last source. ``eps_tensor``/``out_eps_tensor`` (0-dim CPU tensors,
    ``torch.compile(dynamic=True)``'s form of a float eps) replace ``eps``/``out_eps``.
    """
    raise NotImplementedError(f"k3fusion::attn_res has no kernel for {prefix.device.type}")


def _check_functional(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta, out_norm_w,
                      out_eps, eps_tensor, out_eps_tensor) -> None:
    check_attn_res_args(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta, -1,
                        out_norm_w, out_eps)
    check_eps_tensor(eps_tensor, "eps_tensor")
    check_eps_tensor(out_eps_tensor, "out_eps_tensor")


@attn_res_op.register_fake
def _(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta=None, out_norm_w=None,
      out_eps=1e-6, out_weight_in_fp32=False, eps_tensor=None, out_eps_tensor=None):
    _check_functional(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta, out_norm_w,
                      out_eps, eps_tensor, out_eps_tensor)
    out = _attn_res_out(prefix, out_norm_w, out_weight_in_fp32)
    if delta is None:
        return [out]
    return [out, torch.empty_like(prefix, memory_format=torch.contiguous_format)]


@attn_res_op.register_kernel(("cpu", "cuda"))
def _(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta=None, out_norm_w=None,
      out_eps=1e-6, out_weight_in_fp32=False, eps_tensor=None, out_eps_tensor=None):
    _check_functional(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta, out_norm_w,
                      out_eps, eps_tensor, out_eps_tensor)
    eps = eps_value(eps, eps_tensor, "eps_tensor")
    out_eps = eps_value(out_eps, out_eps_tensor, "out_eps_tensor")
    prefix2 = as_rows(prefix)
    blocks3 = _block_rows(blocks, prefix2.shape[0], written=False)  # read only: may copy
    if runs_kernel(prefix):
        out = _attn_res_out(prefix, out_norm_w, out_weight_in_fp32)
        new_prefix = None
        if delta is not None:
            new_prefix = torch.empty_like(prefix, memory_format=torch.contiguous_format)
        _attn_res_launch(prefix2, blocks3, num_blocks, norm_w, proj_w, eps, out, delta,
                         None if new_prefix is None else as_rows(new_prefix), -1, out_norm_w,
                         out_eps, out_weight_in_fp32)
        return [out] if new_prefix is None else [out, new_prefix]
    if delta is not None:
        prefix2 = prefix2.clone(memory_format=torch.contiguous_format)  # the reference updates it
    out = reference.attn_res(prefix2, blocks3, num_blocks, norm_w, proj_w, eps,
                             None if delta is None else as_rows(delta), -1, out_norm_w, out_eps,
                             out_weight_in_fp32)
    out = out.reshape(prefix.shape).contiguous()
    return [out] if delta is None else [out, prefix2.view(prefix.shape)]


# ---------------------------------------------------------------- checked entry points
#
# ``torch.ops.k3fusion.*`` parses its arguments against the schema before any Python of
# ours runs: a bool becomes 1.0 or 1, a 0-dim tensor a float, and the autograd wrapper
# runs the implementation with grad mode off. These entry points see the arguments as
# the caller wrote them and the caller's grad mode.


def _attn_res_formula(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta=None,
                      out_norm_w=None, out_eps=1e-6, out_weight_in_fp32=False, eps_tensor=None,
                      out_eps_tensor=None):
    """The functional op in differentiable torch ops (the reference on row views)."""
    rows = as_rows(prefix).clone()  # the reference adds delta into it
    out = reference.attn_res(rows, _block_rows(blocks, rows.shape[0], written=False),
                             num_blocks, norm_w, proj_w, eps_value(eps, eps_tensor, "eps_tensor"),
                             None if delta is None else as_rows(delta), -1, out_norm_w,
                             eps_value(out_eps, out_eps_tensor, "out_eps_tensor"),
                             out_weight_in_fp32).reshape(prefix.shape)
    return [out] if delta is None else [out, rows.view(prefix.shape)]


# ---------------------------------------------------------------- backward


@torch.library.custom_op("k3fusion::attn_res_backward", mutates_args=())
def attn_res_backward_op(
    grad_out: torch.Tensor,
    grad_new_prefix: Optional[torch.Tensor],
    prefix: torch.Tensor,
    blocks: torch.Tensor,
    num_blocks: int,
    norm_w: torch.Tensor,
    proj_w: torch.Tensor,
    eps: float,
    delta: Optional[torch.Tensor] = None,
    out_norm_w: Optional[torch.Tensor] = None,
    out_eps: float = 1e-6,
    out_weight_in_fp32: bool = False,
) -> list[torch.Tensor]:
    """The gradients of ``k3fusion::attn_res`` (the reference's, in fp32): ``[d_prefix,
    d_blocks, d_norm_w, d_proj_w]`` and ``d_out_norm_w`` with ``out_norm_w``. With
    ``delta``, ``d_prefix`` is ``delta``'s too and includes ``grad_new_prefix``;
    ``d_blocks`` is 0 past ``num_blocks``."""
    raise NotImplementedError(f"k3fusion::attn_res_backward has no kernel for "
                              f"{prefix.device.type}")


def _check_backward(grad_out, grad_new_prefix, prefix, blocks, num_blocks, norm_w, proj_w, eps,
                    delta, out_norm_w, out_eps) -> None:
    check_attn_res_args(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta, -1,
                        out_norm_w, out_eps)
    for name, g in (("grad_out", grad_out), ("grad_new_prefix", grad_new_prefix)):
        if g is None:
            continue
        if tuple(g.shape) != tuple(prefix.shape):
            raise ValueError(f"{name} has shape {tuple(g.shape)} but prefix has "
                             f"{tuple(prefix.shape)}")
        if g.device != prefix.device:
            raise ValueError(f"{name} is on {g.device} but prefix is on {prefix.device}")
    if grad_new_prefix is not None and delta is None:
        raise ValueError("grad_new_prefix needs delta (without it the op has no new prefix)")


def _backward_outputs(prefix, blocks, norm_w, proj_w, out_norm_w) -> list[torch.Tensor]:
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format)
            for t in (prefix, blocks, norm_w, proj_w)]
    if out_norm_w is not None:
        outs.append(torch.empty_like(out_norm_w))
    return outs


@attn_res_backward_op.register_fake
def _(grad_out, grad_new_prefix, prefix, blocks, num_blocks, norm_w, proj_w, eps, delta=None,
      out_norm_w=None, out_eps=1e-6, out_weight_in_fp32=False):
    _check_backward(grad_out, grad_new_prefix, prefix, blocks, num_blocks, norm_w, proj_w, eps,
                    delta, out_norm_w, out_eps)
    return _backward_outputs(prefix, blocks, norm_w, proj_w, out_norm_w)


def _rows_for_kernel(t: torch.Tensor) -> torch.Tensor:
    """``[T, H]`` rows with a unit last stride (an incoming gradient may be an expanded one)."""
    rows = as_rows(t)
    return rows if reference.last_dim_contiguous(rows) else rows.contiguous()


@attn_res_backward_op.register_kernel(("cpu", "cuda"))
def _(grad_out, grad_new_prefix, prefix, blocks, num_blocks, norm_w, proj_w, eps, delta=None,
      out_norm_w=None, out_eps=1e-6, out_weight_in_fp32=False):
    _check_backward(grad_out, grad_new_prefix, prefix, blocks, num_blocks, norm_w, proj_w, eps,
                    delta, out_norm_w, out_eps)
    if runs_kernel(prefix):
        prefix2 = as_rows(prefix)
        d_last, d_blocks, d_nw, d_pw, d_onw = kernels.attn_res_backward.attn_res_backward(
            _rows_for_kernel(grad_out),
            None if grad_new_prefix is None else _rows_for_kernel(grad_new_prefix),
            prefix2, _block_rows(blocks, prefix2.shape[0], written=False), num_blocks,
            norm_w, proj_w, eps, delta=None if delta is None else as_rows(delta),
            out_norm_w=out_norm_w, out_eps=out_eps, out_weight_in_fp32=out_weight_in_fp32)
        outs = [d_last.view(prefix.shape), d_blocks.view(blocks.shape), d_nw, d_pw]
        return outs + ([] if d_onw is None else [d_onw])
    return _attn_res_backward_formula(grad_out, grad_new_prefix, prefix, blocks, num_blocks,
                                      norm_w, proj_w, eps, delta, out_norm_w, out_eps,
                                      out_weight_in_fp32)


def _attn_res_backward_formula(grad_out, grad_new_prefix, prefix, blocks, num_blocks, norm_w,
                               proj_w, eps, delta, out_norm_w, out_eps, out_weight_in_fp32):
    """The kernel's gradient formulas (``kernels/attn_res_backward.py``) in plain torch, fp32
    (the softmax backward's shared term summed over the sources here, as ``sum(dm * mix)``
    there: the same sum)."""
    p = prefix if delta is None else (prefix.float() + delta.float()).to(prefix.dtype)
    shape = (_num_rows(prefix), prefix.shape[-1])
    H = shape[1]
    v = torch.cat([_block_rows(blocks, shape[0], written=False)[:, :num_blocks],
                   p.reshape(shape).unsqueeze(1)], 1).float()
    g = norm_w.float() * proj_w.float()
    r = torch.rsqrt(v.pow(2).mean(-1) + eps)
    c = (v * g).sum(-1)
    w = torch.softmax(r * c, -1)
    dm = grad_out.reshape(shape).float()
    if out_norm_w is not None:
        x = (w.unsqueeze(-1) * v).sum(1).to(prefix.dtype).float()
        rho = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + out_eps)
        xn = x * rho if out_weight_in_fp32 else (x * rho).to(prefix.dtype).float()
        d_out_norm_w = (dm * xn).sum(0).to(out_norm_w.dtype)
        dxh = dm * out_norm_w.float()
        dm = rho * dxh - rho.pow(3) * (dxh * x).sum(-1, keepdim=True) / H * x
    dw = (dm.unsqueeze(1) * v).sum(-1)
    dlogit = w * (dw - (w * dw).sum(-1, keepdim=True))
    a, b = dlogit * r, dlogit * c * r.pow(3) / H
    dv = w.unsqueeze(-1) * dm.unsqueeze(1) + a.unsqueeze(-1) * g - b.unsqueeze(-1) * v
    u = (a.unsqueeze(-1) * v).sum((0, 1))
    d_last = dv[:, num_blocks]
    if grad_new_prefix is not None:
        d_last = d_last + grad_new_prefix.reshape(shape).float()
    d_blocks = torch.zeros(shape[0], blocks.shape[-2], H, dtype=blocks.dtype,
                           device=blocks.device)
    d_blocks[:, :num_blocks] = dv[:, :num_blocks].to(blocks.dtype)
    outs = [d_last.to(prefix.dtype).view(prefix.shape), d_blocks.view(blocks.shape),
            (u * proj_w.float()).to(norm_w.dtype), (u * norm_w.float()).to(proj_w.dtype)]
    return outs + ([] if out_norm_w is None else [d_out_norm_w])


def _attn_res_fused_backward(args, grads):
    """Gradients of ``k3fusion::attn_res`` in schema order, from the fused backward op;
    None (the reference's backward instead) on the plain-torch path and for the
    dynamic-shape eps tensors."""
    # The dispatcher drops trailing arguments equal to their defaults: the schema's.
    schema = torch.ops.k3fusion.attn_res.default._schema.arguments
    (prefix, blocks, num_blocks, norm_w, proj_w, eps, delta, out_norm_w, out_eps,
     out_weight_in_fp32, eps_tensor, out_eps_tensor) = list(args) + [
        a.default_value for a in schema[len(args):]]
    if eps_tensor is not None or out_eps_tensor is not None or not runs_kernel(prefix):
        return None
    grad_out = grads[0]
    grad_new_prefix = grads[1] if delta is not None and len(grads) > 1 else None
    if grad_out is None:
        dtype = (prefix.dtype if out_norm_w is None else
                 reference.rms_norm_out_dtype(prefix.dtype, out_norm_w.dtype,
                                              out_weight_in_fp32))
        grad_out = prefix.new_zeros(prefix.shape, dtype=dtype)
    found = torch.ops.k3fusion.attn_res_backward(
        grad_out, grad_new_prefix, prefix, blocks, num_blocks, norm_w, proj_w, eps, delta,
        out_norm_w, out_eps, out_weight_in_fp32)
    result = [None] * len(args)
    result[0], result[1], result[3], result[4] = found[:4]
    if delta is not None:
        result[6] = found[0]
    if out_norm_w is not None:
        result[7] = found[4]
    return result


differentiate_by_reference(attn_res_op, _attn_res_formula, _attn_res_fused_backward)


def attn_res_(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta=None, block_write_idx=-1,
              out_norm_w=None, out_eps=1e-6, out_weight_in_fp32=False):
    """``torch.ops.k3fusion.attn_res_`` (the spec, in place; see
    ``k3fusion.reference.attn_res``) after checking the arguments as given (a bool or
    tensor ``eps``, a bool ``num_blocks`` are refused) and that no tensor it writes
    requires grad while grad mode is on (it has no backward)."""
    check_attn_res_args(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta,
                        block_write_idx, out_norm_w, out_eps)
    _check_no_grad_writes(prefix, blocks, delta, block_write_idx)
    return torch.ops.k3fusion.attn_res_(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta,
                                        block_write_idx, out_norm_w, out_eps, out_weight_in_fp32)


def attn_res(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta=None, out_norm_w=None,
             out_eps=1e-6, out_weight_in_fp32=False, eps_tensor=None, out_eps_tensor=None):
    """``torch.ops.k3fusion.attn_res`` (functional) after checking the arguments as given."""
    _check_functional(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta, out_norm_w,
                      out_eps, eps_tensor, out_eps_tensor)
    return torch.ops.k3fusion.attn_res(prefix, blocks, num_blocks, norm_w, proj_w, eps, delta,
                                       out_norm_w, out_eps, out_weight_in_fp32, eps_tensor,
                                       out_eps_tensor)
