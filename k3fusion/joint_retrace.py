"""Re-derive a joint graph's backward from its fused forward (training compiles).

AOTAutograd traced the joint graph's backward from the unfused forward: its nodes are the
gradient formulas of the chain the pass replaced, and nothing ties them to a site. Once
the forward holds the fused ops, this traces the joint again the way AOTAutograd does --
the forward nodes replayed under autograd, ``torch.autograd.grad`` of its outputs for the
tangents, Inductor's decompositions -- so each fused op contributes its registered
backward (``k3fusion::attn_res_backward`` for AttnRes) and every other op the same
gradient formula as before. docs/architecture.md, "While autograd records", says why here.

It applies only where the pairing of tangents with forward outputs is certain: every
forward output has a tangent (no mutated inputs without gradients, no aliased outputs),
and the new backward yields a gradient exactly where the old one did. Anything else is
a reason, returned, and the caller keeps the old backward.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from .patterns._fx import is_tangent, joint_backward_values

__all__ = ["retrace_joint"]


def _forward_module(graph: Graph, primals: list[Node], fw_outs: list) -> GraphModule:
    """The nodes ``fw_outs`` need, as a module of the primals."""
    needed: set[Node] = set()
    stack = [o for o in fw_outs if isinstance(o, Node)]
    while stack:
        n = stack.pop()
        if n not in needed:
            needed.add(n)
            stack.extend(n.all_input_nodes)
    if any(is_tangent(n) for n in needed):
        raise _Skip("a forward output reads a tangent")
    fwd = Graph()
    env: dict[Node, Node] = {}
    for p in primals:
        env[p] = fwd.placeholder(p.name)
        env[p].meta = dict(p.meta)
    for n in graph.nodes:
        if n in needed and n.op != "placeholder":
            env[n] = fwd.node_copy(n, env.__getitem__)
    fwd.output([env[o] if isinstance(o, Node) else o for o in fw_outs])
    return GraphModule(graph.owning_module or torch.nn.Module(), fwd)


class _Skip(Exception):
    """This joint graph is not one the retrace can pair up: keep its backward."""


class _Replay(torch.fx.Interpreter):
    """Runs the forward's nodes under autograd. Decompositions left ``prims`` ops in it,
    which have no autograd formula: a dtype conversion runs as the aten op it came from;
    any other is a reason to keep the old backward."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.prims.convert_element_type.default:
            return torch.ops.aten._to_copy.default(args[0], dtype=args[1])
        if getattr(target, "namespace", None) == "prims":
            raise _Skip(f"the forward holds {target}, which autograd cannot differentiate")
        return super().call_function(target, args, kwargs)


def _trace(fwd: GraphModule, primal_vals: list, tangent_vals: list, needs: list[bool]):
    from torch._inductor.decomposition import select_decomp_table
    from torch._dispatch.python import enable_python_dispatcher
    from torch.fx import traceback as fx_traceback
    from torch.fx.experimental.proxy_tensor import make_fx

    n_primals = len(primal_vals)

    def joint(*args):
        primals, tangents = args[:n_primals], args[n_primals:]
        with torch.enable_grad():
            with fx_traceback.preserve_node_meta():
                outs = _Replay(fwd).run(*primals)
            pairs = [(o, t) for o, t in zip(outs, tangents)
                     if isinstance(o, torch.Tensor) and o.requires_grad]
            wanted = [p for p, need in zip(primals, needs) if need]
            grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted,
                                             [t for _, t in pairs], allow_unused=True)
                         if pairs and wanted else [None] * len(wanted))
        return [*outs, *[next(grads) if need else None for need in needs]]

    # Leaves of their own (the placeholders' values stay as they were); the gradients'
    # formulas run on this thread, where the tracer is.
    leaves = [v.detach().requires_grad_(need) if isinstance(v, torch.Tensor) else v
              for v, need in zip(primal_vals, needs)]
    with torch.autograd.set_multithreading_enabled(False), enable_python_dispatcher():
        return make_fx(joint, decomposition_table=select_decomp_table())(*leaves, *tangent_vals)


def _mutates(node: Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def retrace_joint(graph: Graph) -> str | None:
    """Replace ``graph``'s nodes with the joint traced again from its forward; None when
    done, else why it was left as it was."""
    try:
        return _retrace(graph)
    except _Skip as why:
        return str(why)


def _retrace(graph: Graph) -> None:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    tangents = [n for n in placeholders if is_tangent(n)]
    primals = [n for n in placeholders if not is_tangent(n)]
    if placeholders != primals + tangents:
        raise _Skip("the joint's inputs are not its primals followed by its tangents")
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    outs = output.args[0]
    if not isinstance(outs, (list, tuple)) or len(outs) != len(primals) + len(tangents):
        raise _Skip("not every forward output has a tangent")
    fw_outs, grads = list(outs[:len(tangents)]), list(outs[len(tangents):])
    needs = [g is not None for g in grads]
    vals = [n.meta.get("val") for n in placeholders]
    if any(v is None for v in vals):
        raise _Skip("an input has no traced value")
    for o, t in zip(fw_outs, tangents):
        val = o.meta.get("val") if isinstance(o, Node) else None
        if not isinstance(val, torch.Tensor) or val.shape != t.meta["val"].shape:
            raise _Skip("a forward output does not match its tangent")

    new = _trace(_forward_module(graph, primals, fw_outs), vals[:len(primals)],
                 vals[len(primals):], needs)
    new_graph = new.graph
    new_outs = next(n for n in new_graph.nodes if n.op == "output").args[0]
    if [g is not None for g in new_outs[len(fw_outs):]] != needs:
        raise _Skip("the traced backward's gradients differ from the joint's in which "
                    "inputs get one")
    if any(_mutates(n) for n in new_graph.nodes):
        raise _Skip("the traced joint writes in place")

    _install(graph, placeholders, new)
    return None


def _install(graph: Graph, placeholders: list[Node], new: GraphModule) -> None:
    """``graph``'s nodes (placeholders kept: the partitioner knows them by name) replaced
    by ``new``'s."""
    owner = graph.owning_module
    new_graph = new.graph
    for n in new_graph.nodes:  # constants the trace lifted
        if n.op == "get_attr":
            if owner is None:
                raise _Skip("the joint has no module to hold a constant")
            name = f"_k3fusion_retrace_{n.target}"
            while hasattr(owner, name):
                name += "_"
            setattr(owner, name, getattr(new, n.target))
            n.target = name
    for n in reversed(list(graph.nodes)):
        if n.op != "placeholder":
            graph.erase_node(n)
    new_placeholders = [n for n in new_graph.nodes if n.op == "placeholder"]
    result = graph.graph_copy(new_graph, dict(zip(new_placeholders, placeholders)))
    graph.output(result)
    # What the partitioner and Inductor's passes read: a backward node reads a tangent.
    backward = joint_backward_values(graph).backward
    for n in graph.nodes:
        if n.op != "placeholder":
            n.meta["partitioner_tag"] = "is_backward" if n in backward else "is_forward"
