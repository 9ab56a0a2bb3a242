"""A fast harness for graph-pass tests: real Inductor up to its post-grad passes, no codegen.

:class:`CaptureBackend` is a dynamo backend that calls Inductor's own ``compile_fx`` (so the
pre-grad passes, AOT autograd with Inductor's decomposition table, the joint-graph passes and
the real ``post_grad_passes`` -- which invoke ``config.post_grad_custom_post_pass`` -- all run
exactly as under ``torch.compile(backend="inductor")``), but hands ``compile_fx`` an
``inner_compile`` that stops after the post-grad passes: it returns the post-grad graph
module to be run eagerly instead of generating C++/Triton code. A compile therefore costs
a fraction of a second, and the graph our pass sees is the graph it sees under real
Inductor (``tests/test_compile_model.py`` checks that once against a real compile).

What it records, per compiled graph:

* ``before`` / ``after``: copies of the graph right before and right after the pass under
  test (when the backend installs it as ``post_grad_custom_post_pass``);
* ``final``: the graph module after every post-grad pass (what Inductor would lower).

Caches: Inductor's FX graph cache and AOT autograd's cache skip custom passes on a hit,
so :func:`no_compile_caches` turns them off; tests that count matches use it.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections import Counter
from typing import Any, Callable, Iterable, Iterator

import pytest
import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

import k3fusion
from k3fusion.config import FusionConfig
from k3fusion.pass_manager import K3FusionPass
from k3fusion.patterns.rms_norm import find_rms_norms

aten = torch.ops.aten
RSQRT = aten.rsqrt.default
DUAL = torch.ops.k3fusion.dual_rms_norm.default

__all__ = [
    "RSQRT", "DUAL", "CaptureBackend", "LoweringBackend", "no_compile_caches", "fresh_state", "gpu_gemm_forms", "compile_capture",
    "count_op", "nodes_of", "op_histogram", "norm_width", "rsqrt_widths", "norms_by_width",
    "assert_no_unfused_norm", "graph_code", "assert_close_rounding", "K3Calls", "SideBySide",
    "gpu_softmax_form",
]

_DEFAULT = object()


# --------------------------------------------------------------------------- caches / state


@contextlib.contextmanager
def no_compile_caches() -> Iterator[None]:
    """Turn off every compile cache that would skip the custom post-grad pass."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    with inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False), \
            functorch_config.patch(enable_autograd_cache=False,
                                   enable_remote_autograd_cache=False):
        yield


@pytest.fixture
def fresh_state() -> Iterator[None]:
    """A clean compile state: dynamo reset, counts zeroed, default k3fusion config, no caches,
    and whatever ``post_grad_custom_post_pass`` / ``install()`` state a test leaves undone."""
    from torch._inductor import config as inductor_config

    from k3fusion import backend as k3backend

    saved_config = k3fusion.get_config()
    saved_pass = inductor_config.post_grad_custom_post_pass
    saved_installed = list(k3backend._previous)
    torch._dynamo.reset()
    k3fusion.reset_match_counts()
    k3fusion.set_config(FusionConfig())
    try:
        with no_compile_caches():
            yield
    finally:
        torch._dynamo.reset()
        k3fusion.reset_match_counts()
        k3fusion.set_config(saved_config)
        inductor_config.post_grad_custom_post_pass = saved_pass
        k3backend._previous[:] = saved_installed


# --------------------------------------------------------------------------- GPU graph forms


class _OnlineSoftmax(CustomGraphPass):
    """Inductor's own online-softmax rewrite (its post-grad pattern and replacement, taken
    from ``torch._inductor.fx_passes.post_grad``) without its device check; ``rewrites``
    counts the softmaxes it rewrote."""

    def __init__(self) -> None:
        from torch._inductor.fx_passes import post_grad
        from torch._inductor.pattern_matcher import (PatternMatcherPass, fwd_only,
                                                     register_replacement)

        self.patterns = PatternMatcherPass()
        register_replacement(post_grad.prepare_softmax_pattern,
                             post_grad.prepare_softmax_replacement, [torch.empty(4, 8)],
                             scalar_workaround=dict(dim=-1), trace_fn=fwd_only,
                             pass_dicts=self.patterns)
        self.rewrites = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.rewrites += self.patterns.apply(graph)

    def uuid(self) -> None:  # never cacheable: a test harness
        return None


@contextlib.contextmanager
def gpu_softmax_form() -> Iterator[_OnlineSoftmax]:
    """Compiles under this build the softmax a CUDA compile builds: Inductor rewrites
    ``amax, sub, exp, sum`` into ``prepare_softmax_online`` (one reduction for the max and
    the sum of exps) in its post-grad patterns, but only on a GPU with Triton. Installed
    as ``post_grad_custom_pre_pass``, the same rewrite runs ahead of those patterns here
    (the fusion passes run after them, as on a GPU). Yields the pass (``.rewrites``)."""
    from torch._inductor import config as inductor_config

    online = _OnlineSoftmax()
    with inductor_config.patch(post_grad_custom_pre_pass=online):
        yield online


def _coordinate_descent_decompositions() -> dict:
    """Inductor's ``bmm`` / ``mm`` decompositions as a GPU build runs them under
    coordinate-descent tuning (``mode="max-autotune"``): a GEMM of one row or one column
    becomes an fp32 broadcast multiply and sum (the CPU build makes other forms, or none)."""
    from torch._decomp.decompositions import pw_cast_for_opmath
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    aten = torch.ops.aten

    @pw_cast_for_opmath
    def bmm(self, batch2, out_dtype=None):
        if out_dtype is None and (known(self.shape[1] == 1) or known(batch2.shape[2] == 1)):
            return (self.unsqueeze(-1) * batch2.unsqueeze(1)).sum(dim=2)
        return NotImplemented

    @pw_cast_for_opmath
    def mm(self, input2, out_dtype=None):
        if out_dtype is None and (known(self.shape[0] == 1) or known(input2.shape[1] == 1)):
            return (self.unsqueeze(2) * input2.unsqueeze(0)).sum(dim=1)
        if (out_dtype is None and known(self.size(-1) == 1) and known(self.size(0) != 1)
                and known(input2.size(1) != 1)):
            return self * input2
        return NotImplemented

    return {aten.bmm.default: bmm, aten.mm.default: mm}


@contextlib.contextmanager
def gpu_gemm_forms(max_autotune: bool = False) -> Iterator[None]:
    """Compiles under this build the GEMMs a CUDA compile may build, which only a GPU build
    makes (the fusion passes run after both):

    * ``pad_mm`` (joint graph) pads every GEMM whose dims are not multiples of 8 (16-bit)
      or 4 (fp32) with zeros and slices the result back. On a GPU its benchmark decides
      per GEMM -- a timing, so one compile may get the padded form and the next not --
      and fp32 only under TF32; here every such GEMM is padded.
    * ``unfuse_bias_add_to_pointwise`` (post-grad) splits an ``addmm`` that only pointwise
      ops read into ``mm`` + a bias add (fp32; 16-bit ``addmm`` stays whole off XPU).
    * ``max_autotune``: also the decompositions of one-row / one-column GEMMs that
      ``mode="max-autotune"`` (coordinate-descent tuning) makes on a GPU, before ``pad_mm``.
    """
    from unittest import mock

    from torch._inductor import config as inductor_config
    from torch._inductor import decomposition
    from torch._inductor.fx_passes import pad_mm, post_grad

    cached = getattr(decomposition.fast_random_decomps, "cache_clear", lambda: None)
    table = _coordinate_descent_decompositions() if max_autotune else {}
    with mock.patch.object(pad_mm, "has_triton", lambda: True), \
            mock.patch.object(pad_mm, "check_device", lambda a, b: True), \
            mock.patch.object(post_grad, "is_gpu", lambda device_type: True), \
            mock.patch.dict(decomposition.decompositions, table), \
            inductor_config.patch(force_shape_pad=True):
        cached()
        try:
            yield
        finally:
            cached()


# --------------------------------------------------------------------------- the backend


class _RecordingPass(CustomGraphPass):
    """``post_grad_custom_post_pass`` that snapshots the graph around the pass under test."""

    def __init__(self, owner: "CaptureBackend", inner: Callable[[fx.Graph], None] | None):
        self.owner, self.inner = owner, inner

    def __call__(self, graph: fx.Graph) -> None:
        self.owner.before.append(copy.deepcopy(graph))
        if self.inner is not None:
            self.inner(graph)
        self.owner.after.append(copy.deepcopy(graph))

    def uuid(self) -> None:  # never cacheable: a test harness
        return None


class CaptureBackend:
    """Dynamo backend: Inductor's passes for real, then run the post-grad graph eagerly.

    ``fusion_pass``: the pass to run as ``post_grad_custom_post_pass`` (default: a fresh
    :class:`K3FusionPass`; ``None``: no pass, just capture). ``use_config_pass=True`` leaves
    ``torch._inductor.config.post_grad_custom_post_pass`` alone (for ``install()`` tests);
    then ``before``/``after`` stay empty and only ``final`` is recorded.
    """

    def __init__(self, fusion_pass: Any = _DEFAULT, *, use_config_pass: bool = False) -> None:
        self.fusion_pass = K3FusionPass() if fusion_pass is _DEFAULT else fusion_pass
        self.use_config_pass = use_config_pass
        self.before: list[fx.Graph] = []
        self.after: list[fx.Graph] = []
        self.final: list[fx.GraphModule] = []
        self.compiles = 0  # graphs compiled (successfully) through this backend
        self.runtime_args: list[list] = []  # what each run of a compiled graph was given

    def __call__(self, gm: fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        patches: dict[str, Any] = {"fx_graph_cache": False, "fx_graph_remote_cache": False}
        if not self.use_config_pass:
            patches["post_grad_custom_post_pass"] = _RecordingPass(self, self.fusion_pass)
        with no_compile_caches():
            compiled = compile_fx(gm, example_inputs, inner_compile=self._inner_compile,
                                  config_patches=patches)
        # counted on success only: dynamo may restart an analysis (e.g. when it tensorifies
        # a Python float under dynamic=True), calling the backend twice for one graph
        self.compiles += 1
        return compiled

    def _inner_compile(self, gm: fx.GraphModule, example_inputs, **kwargs):
        """What ``compile_fx_inner`` does up to (and including) the post-grad passes."""
        from torch._functorch.aot_autograd import make_boxed_func
        from torch._inductor.compile_fx import _recursive_post_grad_passes, fake_tensor_prop
        from torch._inductor.fx_passes.post_grad import view_to_reshape
        from torch._inductor.virtualized import V

        view_to_reshape(gm)
        with torch.no_grad():
            fake_mode = fake_tensor_prop(gm, example_inputs)
        with V.set_fake_mode(fake_mode):
            _recursive_post_grad_passes(gm, is_inference=kwargs.get("is_inference", False))
        gm.recompile()
        self.final.append(gm)
        return make_boxed_func(self._recording(gm.forward))

    def _recording(self, forward):
        def run(*args):
            self.runtime_args.append(list(args))
            return forward(*args)
        return run

    # convenience views on the last compiled graph
    @property
    def graph_before(self) -> fx.Graph:
        assert self.before, "the pass under test never ran (cache hit or no compile?)"
        return self.before[-1]

    @property
    def graph_after(self) -> fx.Graph:
        assert self.after, "the pass under test never ran (cache hit or no compile?)"
        return self.after[-1]

    @property
    def graph_final(self) -> fx.Graph:
        assert self.final, "nothing was compiled"
        return self.final[-1].graph


class LoweringBackend(CaptureBackend):
    """:class:`CaptureBackend` that also runs the rest of Inductor's compile: lowering to its
    IR (where a fallback op's fake impl re-runs on Inductor's own buffer layouts), scheduling
    and code generation of the wrapper and every kernel, and the load of the generated
    module -- everything but the C++ compiler, whose kernels are replaced by stubs (a C++
    compile costs seconds per graph on a CPU and cannot fail because of a k3fusion op, which
    is an extern call in the wrapper). Then, as CaptureBackend does, the post-grad graph
    Inductor lowered (``final``) runs eagerly. ``lowered`` counts the graphs that went
    through lowering and codegen.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lowered = 0

    def _inner_compile(self, gm: fx.GraphModule, example_inputs, **kwargs):
        from unittest import mock

        from torch._functorch.aot_autograd import make_boxed_func
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.graph import GraphLowering

        lowered: list[fx.GraphModule] = []
        real_run = GraphLowering.run

        def run(graph, *args):
            lowered.append(copy.deepcopy(graph.module))  # the graph Inductor lowers
            return real_run(graph, *args)

        def not_compiled(*args, **kwargs):
            def kernel(*a, **k):
                raise AssertionError("LoweringBackend does not compile C++ kernels")
            return kernel

        with mock.patch.object(GraphLowering, "run", run), \
                mock.patch.object(AsyncCompile, "cpp", not_compiled), \
                mock.patch.object(AsyncCompile, "cpp_pybinding", not_compiled):
            compile_fx_inner(gm, example_inputs, **kwargs)
        assert lowered, "Inductor lowered no graph"
        final = lowered[-1]
        final.recompile()
        self.final.append(final)
        self.lowered += 1
        return make_boxed_func(self._recording(final.forward))


def compile_capture(fn: Callable, *args, fusion_pass: Any = _DEFAULT, dynamic: bool | None = False,
                    grad: bool = False, **kwargs) -> tuple[Any, CaptureBackend]:
    """Compile ``fn`` with a fresh :class:`CaptureBackend`, run it once on ``args``.

    Returns (output, backend). Runs under ``torch.no_grad()`` (inference graphs, as served);
    ``grad=True``: with autograd recording (a module with parameters that require grad
    then compiles the forward of a training pair, the graph the pass sees).
    """
    torch._dynamo.reset()
    backend = CaptureBackend(fusion_pass)
    compiled = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=True)
    with contextlib.nullcontext() if grad else torch.no_grad():
        out = compiled(*args, **kwargs)
    return out, backend


class SideBySide(torch.nn.Module):
    """Sites called one after the other, each on its own slice of the flat inputs."""

    def __init__(self, sites: list[tuple[torch.nn.Module, int]]) -> None:
        super().__init__()
        self.sites = torch.nn.ModuleList(m for m, _ in sites)
        self.arity = [n for _, n in sites]

    def forward(self, *args):
        outs, i = [], 0
        for site, n in zip(self.sites, self.arity):
            out = site(*args[i:i + n])
            outs += list(out) if isinstance(out, tuple) else [out]
            i += n
        return tuple(outs)


class K3Calls:
    """The ``torch.ops.k3fusion`` calls of a compiled graph, with each tensor argument named
    by the parameter of ``model`` it is (or views; None for anything else): read off the
    last graph a :class:`CaptureBackend` ran, and the tensors it ran on."""

    def __init__(self, backend: "CaptureBackend", model: torch.nn.Module) -> None:
        params = {p.data_ptr(): n for n, p in model.named_parameters()}
        graph = backend.graph_final
        inputs = [n for n in graph.nodes if n.op == "placeholder"]
        runtime = backend.runtime_args[-1]
        self.calls: list[tuple[str, dict]] = []
        self._names: dict[int, str | None] = {}
        for node in graph.nodes:
            call = k3_call(node)
            if call is None:
                continue
            op, bound = call
            for key, arg in bound.items():
                base = arg
                while isinstance(base, fx.Node) and base.op == "call_function" and \
                        base.target in (aten.view.default, aten.reshape.default,
                                        aten.squeeze.dim, aten.permute.default):
                    base = base.args[0]
                if isinstance(base, fx.Node) and base.op == "placeholder":
                    t = runtime[inputs.index(base)]
                    self._names[id(arg)] = params.get(t.data_ptr()) \
                        if isinstance(t, torch.Tensor) else None
            self.calls.append((op, bound))

    def name(self, arg) -> str | None:
        return self._names.get(id(arg))

    def of(self, op: str) -> list[dict]:
        return [a for name, a in self.calls if name == op]


# --------------------------------------------------------------------------- graph queries


def k3_call(node: fx.Node) -> tuple[str, dict] | None:
    """``(op name, arguments by name)`` of a ``torch.ops.k3fusion`` call, None for any other
    node. An in-place variant (``latent_moe_tail_``), called directly or under
    ``auto_functionalized``, is named as its functional op: the same call, its result
    written into an input."""
    if node.op != "call_function":
        return None
    target, args = node.target, node.args
    if target is torch.ops.higher_order.auto_functionalized:
        target, args = args[0], ()
    if getattr(target, "namespace", None) != "k3fusion":
        return None
    schema = [a.name for a in target._schema.arguments]
    bound = dict(zip(schema, args))
    bound.update(node.kwargs)
    return target.overloadpacket.__name__.rstrip("_"), bound


def k3_calls(graph: fx.Graph | fx.GraphModule, op: str) -> list[dict]:
    """The arguments (by name) of every call of k3fusion's ``op`` in ``graph``
    (:func:`k3_call`)."""
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return [c[1] for c in map(k3_call, graph.nodes) if c is not None and c[0] == op]


def _matches(node: fx.Node, target) -> bool:
    if node.op != "call_function":
        return False
    if node.target is target:
        return True
    # an OpOverloadPacket matches each of its overloads
    return isinstance(target, torch._ops.OpOverloadPacket) and \
        getattr(node.target, "overloadpacket", None) is target


def nodes_of(graph: fx.Graph | fx.GraphModule, target) -> list[fx.Node]:
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return [n for n in graph.nodes if _matches(n, target)]


def count_op(graph: fx.Graph | fx.GraphModule, target) -> int:
    """Number of ``call_function`` nodes calling ``target`` (an overload, or any overload
    of a packet)."""
    return len(nodes_of(graph, target))


def op_histogram(graph: fx.Graph | fx.GraphModule) -> Counter:
    """Multiset of call_function targets (as strings): the graph's form, names aside."""
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return Counter(str(n.target) for n in graph.nodes if n.op == "call_function")


def graph_code(graph: fx.Graph | fx.GraphModule) -> str:
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    return graph.python_code("self").src


def norm_width(rsqrt: fx.Node) -> int:
    """Row width of the norm an ``rsqrt`` belongs to: the width of the tensor whose mean
    of squares it inverts (read off the square/mean chain, whatever consumes it)."""
    node = rsqrt.args[0]
    for _ in range(4):  # rsqrt <- add <- mean <- square
        if _matches(node, aten.mean.dim):
            return int(node.args[0].meta["val"].shape[-1])
        node = next((a for a in node.args if isinstance(a, fx.Node)), None)
        if node is None:
            break
    raise AssertionError(f"{rsqrt.name} does not invert a mean of squares")


def rsqrt_widths(graph: fx.Graph | fx.GraphModule) -> Counter:
    """{row width: number of rsqrt-based norms of that width} in ``graph``."""
    return Counter(norm_width(n) for n in nodes_of(graph, RSQRT))


def norms_by_width(graph: fx.Graph | fx.GraphModule) -> Counter:
    """{row width: RMSNorms the recognizer finds} in ``graph``."""
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    matches, _ = find_rms_norms(graph)
    return Counter(m.width for m in matches)


def assert_no_unfused_norm(graph: fx.Graph | fx.GraphModule, widths: Iterable[int]) -> None:
    """No rsqrt (so no aten RMSNorm, recognized or not) of these row widths remains."""
    widths = set(widths)
    left = {w: n for w, n in rsqrt_widths(graph).items() if w in widths}
    assert not left, f"unfused rsqrt-based norms left, {{width: count}} = {left}"


# --------------------------------------------------------------------------- numerics


def assert_close_rounding(actual: torch.Tensor, expected: torch.Tensor,
                          ulps: int | None = None, rounded: torch.dtype | None = None) -> None:
    """Equal up to a few roundings of the output dtype (same dtype and shape).

    Outputs of the fused op may differ from eager by a few ulps: on CPU the tests run the
    Triton kernel in Triton's interpreter, whose bf16 casts truncate (up to 3 bf16 ulps for
    cast-then-weight), and its fp32 sum of squares runs in another order (up to ~8 fp32
    ulps, see tests/_tolerances.py). Elements far below the tensor's largest are held to
    the same absolute error as it (they come out of matmuls with cancellation). A wrong
    eps, weight or pairing is off by orders of magnitude more.
    """
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, \
        (actual.dtype, expected.dtype, actual.shape, expected.shape)
    # ``rounded``: a narrower dtype the values were rounded to on the way (its ulps count).
    dtype = expected.dtype if rounded is None else rounded
    if ulps is None:
        ulps = 8 if dtype == torch.float32 else 4
    eps = torch.finfo(dtype).eps
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=ulps * eps, atol=ulps * eps * scale)


def expected_from(*verdicts: bool | None) -> bool | None:
    """Combine per-part verdicts of a mutation (True: keeps the op, False: breaks it,
    None: either): any False breaks the site, else any None leaves it open."""
    if any(v is False for v in verdicts):
        return False
    return None if any(v is None for v in verdicts) else True


#: The thorough profile lowers every fused mutation draw; CI lowers each site form once
#: (test_mutation_sites_compile.py) to stay inside its time.
LOWER_EVERY_DRAW = os.environ.get("HYPOTHESIS_PROFILE") == "dev"


def check_mutated_site(module: torch.nn.Module, args: tuple, fusion: str,
                       expect: bool | None, *, dynamic: bool, what: str,
                       rounded: torch.dtype, grad: bool = False) -> int:
    """The mutation tests' rule for one drawn site: run the real passes (no codegen) and
    require ``fusion`` to match exactly when ``expect`` says so; an unfused site must leave
    the graph exactly as it was; every output equals eager within ``rounded``'s rounding.
    ``grad``: compiled with autograd recording (the forward of a training pair), where the
    same sites fuse. Lowering and codegen of every site a rewrite may touch:
    ``test_mutation_sites_compile.py`` (side by side, one compile per token count); the
    thorough profile (``HYPOTHESIS_PROFILE=dev``) also lowers each fused draw."""
    with torch.no_grad():
        want = module(*args)
    k3fusion.reset_match_counts()
    with no_compile_caches():
        got, be = compile_capture(module, *args, dynamic=dynamic, grad=grad)
    fused = k3fusion.match_counts().get(fusion, 0)
    if expect is not None:
        assert fused == int(expect), f"{what}: fused {fused}, expected {int(expect)}"
    else:
        assert fused in (0, 1), what
    if fused and LOWER_EVERY_DRAW:  # its dtype, lead dims and grad mode, codegen included
        torch._dynamo.reset()
        k3fusion.reset_match_counts()
        with contextlib.nullcontext() if grad else torch.no_grad(), no_compile_caches():
            got = torch.compile(module, backend=LoweringBackend(), dynamic=dynamic)(*args)
        assert k3fusion.match_counts().get(fusion, 0) == 1, what
    if not fused:  # left exactly as it was: what Inductor compiles is default Inductor's graph
        assert op_histogram(be.graph_after) == op_histogram(be.graph_before), what
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        assert_close_rounding(a.detach(), b, rounded=rounded)
    return fused
