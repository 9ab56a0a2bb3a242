"""``k3fusion.ops.*`` check their arguments as the caller wrote them (issue 16 item 7).

``torch.ops.k3fusion.*`` parses arguments against the schema before any Python of ours
runs: ``eps=True`` arrives as 1.0, ``num_blocks=True`` as 1, a 0-dim tensor eps as a
float. The ``k3fusion.ops`` entry points (and the eager wrappers) see the raw values and
refuse them as the wrappers do, naming the argument, before anything launches.
"""

from __future__ import annotations

import pytest
import torch

from k3fusion import eager, ops

H = 8


def _attn(**kw):
    args = dict(prefix=torch.randn(3, H), blocks=torch.randn(3, 4, H), num_blocks=2,
                norm_w=torch.rand(H) + 0.5, proj_w=torch.randn(H), eps=1e-6)
    args.update(kw)
    return args


BAD = [
    ("eps", True, TypeError), ("eps", torch.tensor(1e-6), TypeError), ("eps", "1e-6", TypeError),
    ("num_blocks", True, TypeError), ("num_blocks", torch.tensor(2), TypeError),
    ("out_eps", False, TypeError),
]


@pytest.mark.parametrize("name,value,exc", BAD, ids=lambda v: repr(v)[:20])
@pytest.mark.parametrize("entry", ["ops.attn_res_", "ops.attn_res", "eager.attn_res"])
def test_attn_res_entry_points_refuse_what_the_schema_would_convert(entry, name, value, exc):
    fn = {"ops.attn_res_": ops.attn_res_, "ops.attn_res": ops.attn_res,
          "eager.attn_res": eager.attn_res}[entry]
    args = _attn(**{name: value})
    before = args["prefix"].clone()
    with pytest.raises(exc, match=name):
        fn(**args)
    assert torch.equal(args["prefix"], before)


@pytest.mark.parametrize("entry", ["ops.attn_res_", "eager.attn_res"])
def test_block_write_idx_bool_is_refused(entry):
    fn = ops.attn_res_ if entry == "ops.attn_res_" else eager.attn_res
    with pytest.raises(TypeError, match="block_write_idx"):
        fn(**_attn(num_blocks=0, block_write_idx=True))


def test_the_dispatcher_entry_converts_them():
    """Why the checked entry points exist: the schema turns True into 1.0 before the op."""
    args = _attn()
    out = torch.ops.k3fusion.attn_res(**{**args, "eps": True})[0]
    assert torch.equal(out, ops.attn_res(**{**args, "eps": 1.0})[0])


@pytest.mark.parametrize("value", [True, torch.tensor(1e-6)], ids=["bool", "tensor"])
def test_norm_entry_points_refuse_a_converted_eps(value):
    x, w = torch.randn(3, H), torch.rand(H) + 0.5
    with pytest.raises(TypeError, match="eps"):
        ops.rms_norm(x, w, value)
    with pytest.raises(TypeError, match="eps1"):
        ops.dual_rms_norm(x, w, value, x, w, 1e-6)
    with pytest.raises(TypeError, match="eps2"):
        ops.dual_rms_norm(x, w, 1e-6, x, w, value)
    with pytest.raises(TypeError, match="eps"):
        ops.latent_moe_tail(x, torch.randn(3, 5), w, value, torch.randn(5, H), None)


def test_entry_points_compute_the_op():
    x, w = torch.randn(3, H), torch.rand(H) + 0.5
    assert torch.equal(ops.rms_norm(x, w, 1e-6), torch.ops.k3fusion.rms_norm(x, w, 1e-6))
    got = ops.dual_rms_norm(x, w, 1e-6, x, w, 1e-5)
    want = torch.ops.k3fusion.dual_rms_norm(x, w, 1e-6, x, w, 1e-5)
    assert all(torch.equal(g, v) for g, v in zip(got, want))
    s, up = torch.randn(3, 5), torch.randn(5, H)
    assert torch.equal(ops.latent_moe_tail(x, s, w, 1e-6, up, None),
                       torch.ops.k3fusion.latent_moe_tail(x, s, w, 1e-6, up, None))
