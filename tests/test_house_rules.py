"""House rules over the library's source (issue 19): code says why, the docs say how fast.

* No module docstring over ``MAX_DOCSTRING_LINES`` lines, in library code and in
  ``k3fusion/bench/``: what and why; the design explanations live in
  ``docs/design-notes.md``, how each benchmark measures in ``docs/bench-methods.md``.
* No timing figure in library code (times, bandwidths, speedups, "on the H200"):
  measurements live in ``docs/benchmarks.md`` / ``docs/experiments.md``.
* No import circle among the project's modules (``k3fusion``, ``k3fusion.kernels``,
  ``k3fusion.patterns``, bench included), from their module-level imports; imports inside
  functions are not followed.
* One list of fusions (issue 32): no list, tuple, set or dict in library code names two
  fusions (their ``match_counts()`` names) but ``patterns/registry.py`` and a fusion's own
  modules; every other place listing fusions iterates the registry.

Library code: ``k3fusion/**/*.py`` except ``k3fusion/bench/`` (the benchmarks print and
document timings, so only the docstring rule covers them), ``patterns/*.py`` and
``kernels/*.py``. Static: files are read, never imported.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_DOCSTRING_LINES = 20

#: A measured figure: a time with its unit, a bandwidth, a speedup or a percentage
#: faster/slower, or the GPU it was measured on. Shape factors (``2x``, ``4x16`` tiles,
#: ``1x8``) carry no decimal point and no faster/slower, so they do not match.
TIMING_FIGURE = re.compile(
    r"""
      \b\d+(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?\s*(?:us|µs|ms|ns)\b     # 15.4 us, 28-32 us
    | \b\d+(?:\.\d+)?\s*[GT]B/s                                     # 3.2 TB/s
    | \b\d+\.\d+\s*x\b                                              # 1.45x
    | \b\d+(?:\.\d+)?\s*x\s+(?:faster|slower)\b                     # 13x slower
    | \b\d+(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?\s*%\s+(?:faster|slower)\b   # 2-3% faster
    | \bH[12]00s?\b                                                 # "on the H200"
    """,
    re.VERBOSE | re.IGNORECASE,
)

#: (file, text of the flagged line) -> why it stays.
ALLOWED = {
    ("k3fusion/cli.py", "see docs/benchmarks.md for results measured on an H200"):
        "user-facing CLI output (issue 19 keeps CLI output unchanged); it points at the docs",
    ("kernels/attn_res.py", '    "NVIDIA H100 80GB HBM3": {'):
        "a device name the AttnRes launch table's rows are keyed by (data, not a figure)",
}


def library_files() -> list[Path]:
    files: list[Path] = []
    # k3fusion/kernels and k3fusion/patterns may be symlinks to the top-level packages:
    # os.walk does not follow them, and the top-level packages are listed below.
    for dirpath, dirnames, filenames in os.walk(ROOT / "k3fusion"):
        rel = Path(dirpath).relative_to(ROOT)
        dirnames[:] = sorted(d for d in dirnames if not (rel == Path("k3fusion") and d == "bench")
                             and d != "__pycache__")
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    for package in ("patterns", "kernels"):
        files += sorted((ROOT / package).glob("*.py"))
    return files


def bench_files() -> list[Path]:
    return sorted((ROOT / "k3fusion" / "bench").glob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def docstring_too_long(source: str) -> int | None:
    """The module docstring's line count if it is over the limit, else None."""
    doc = ast.get_docstring(ast.parse(source), clean=False)
    n = len(doc.splitlines()) if doc else 0
    return n if n > MAX_DOCSTRING_LINES else None


def timing_figures(rel: str, source: str) -> list[str]:
    """``line: text`` of every timing figure in ``source`` outside :data:`ALLOWED`. A figure
    broken over two lines (``~13x`` / ``# slower``) is found too: the text is searched
    with each line break and comment marker folded into one space."""
    hits = []
    lines = source.splitlines()
    for i, line in enumerate(lines):
        nxt = lines[i + 1].strip().lstrip("#:").strip() if i + 1 < len(lines) else ""
        joined = line + " " + nxt
        for m in TIMING_FIGURE.finditer(joined):
            if m.start() >= len(line):
                continue  # starts on the next line: reported there
            if any(f == rel and text in line for f, text in ALLOWED):
                continue
            hits.append(f"{i + 1}: {line.strip()}")
            break
    return hits


def test_library_files_found():
    rels = {_rel(p) for p in library_files()}
    assert {"k3fusion/moe_tail/tiers.py", "kernels/attn_res.py", "patterns/attn_res.py"} <= rels
    assert not any(r.startswith("k3fusion/bench/") for r in rels)


@pytest.mark.parametrize("text", [
    "took 15.4 us at T = 1", "6.04-6.26 us", "8.6 µs", "3 ms", "28-32 us", "1.45x",
    "1.18x geomean", "~13x slower", "2-3% faster", "on the H200", "two H200s", "3.2 TB/s",
])
def test_timing_figure_regex_flags_measurements(text):
    assert TIMING_FIGURE.search(text)


@pytest.mark.parametrize("text", [
    "2x the rows", "shape 4x16", "1x8 tiles", "x.view(2, -1)", "users", "1024 x 4",
    "sms = 132", "T * H", "status", "num_warps=4", "H = 7168", "mean alone", "bus",
])
def test_timing_figure_regex_leaves_code_alone(text):
    assert not TIMING_FIGURE.search(text)


def test_figure_split_over_two_lines_is_found():
    assert timing_figures("x.py", "# runs ~13x\n# slower than tl.sum\n") == ["1: # runs ~13x"]


def test_allowlist_entries_still_exist():
    """An allowlist entry whose line is gone is stale: remove it."""
    for rel, text in ALLOWED:
        assert text in (ROOT / rel).read_text(), (rel, text)


def test_module_docstrings_are_short():
    long = {_rel(p): n for p in library_files()
            if (n := docstring_too_long(p.read_text())) is not None}
    assert not long, (f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the design "
                      f"to docs/design-notes.md): {long}")


def test_bench_module_docstrings_are_short():
    """The benchmarks too: usage and what is measured; the method is in the docs."""
    assert {"decoder.py", "moe_tail_tp.py", "__init__.py"} <= {p.name for p in bench_files()}
    long = {_rel(p): n for p in bench_files()
            if (n := docstring_too_long(p.read_text())) is not None}
    assert not long, (f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the method "
                      f"to docs/bench-methods.md): {long}")


def test_no_timing_figures_in_library_code():
    found = {}
    for p in library_files():
        hits = timing_figures(_rel(p), p.read_text())
        if hits:
            found[_rel(p)] = hits
    assert not found, ("timing figures in library code (move them to docs/experiments.md "
                       f"or docs/benchmarks.md, keep a link): {found}")


def project_modules() -> dict[str, Path]:
    """Dotted name -> file for every module of the package (``kernels/`` and ``patterns/``
    as ``k3fusion.kernels`` / ``k3fusion.patterns``, whether or not the symlinks exist)."""
    def name(parts, filename):
        return ".".join(list(parts) + ([] if filename == "__init__.py" else [filename[:-3]]))
    mods: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(ROOT / "k3fusion"):
        rel = Path(dirpath).relative_to(ROOT)
        dirnames[:] = [d for d in dirnames if d != "__pycache__"
                       and not (rel == Path("k3fusion") and d in ("kernels", "patterns"))]
        for f in filenames:
            if f.endswith(".py"):
                mods[name(rel.parts, f)] = Path(dirpath) / f
    for package in ("kernels", "patterns"):
        for f in (ROOT / package).glob("*.py"):
            mods[name(("k3fusion", package), f.name)] = f
    return mods


def _module_level_imports(stmts):
    """Import statements that run when the module is imported: not inside a function, not
    under ``if TYPE_CHECKING:``."""
    for s in stmts:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            yield s
        elif isinstance(s, ast.If) and "TYPE_CHECKING" in ast.unparse(s.test):
            yield from _module_level_imports(s.orelse)
        else:
            for field in ("body", "orelse", "finalbody"):
                yield from _module_level_imports(getattr(s, field, None) or [])
            for handler in getattr(s, "handlers", None) or []:
                yield from _module_level_imports(handler.body)


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules its module-level imports name. ``from p import n``
    points at ``p.n`` when that is a module, else at ``p``; the parent packages an import
    runs on the way are not edges (a submodule importing a sibling is no circle)."""
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: set[str] = set()
        for s in _module_level_imports(ast.parse(path.read_text()).body):
            if isinstance(s, ast.Import):
                edges |= {a.name for a in s.names}
                continue
            target = s.module or ""
            if s.level:
                parts = package.split(".")
                base = parts[:len(parts) - (s.level - 1)]
                target = ".".join(base + ([s.module] if s.module else []))
            for a in s.names:
                edges.add(f"{target}.{a.name}" if f"{target}.{a.name}" in mods else target)
        graph[mod] = {e for e in edges if e in mods and e != mod}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if not state.get(v) and (cycle := visit(v)):
                return cycle
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if not state.get(u) and (cycle := visit(u)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_resolves_relative_and_absolute_imports():
    mods = project_modules()
    graph = import_graph(mods)
    assert "k3fusion.kernels._launch" in graph["k3fusion.kernels.attn_res"]  # from ._launch
    # from .. import reference; from ._args import ...
    assert {"k3fusion.reference", "k3fusion.ops._args"} <= graph["k3fusion.ops.attn_res"]


def test_no_import_circles():
    cycle = find_cycle(import_graph(project_modules()))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_kernels_import_nothing_built_on_them():
    """``kernels/`` is the lowest layer: its modules may use leaf modules
    (``k3fusion.reference``, ``k3fusion.moe_tail_args``), never the ops, tiers, passes or
    eager wrappers built on the kernels (module-level imports, as above)."""
    above = ("k3fusion.ops", "k3fusion.moe_tail", "k3fusion.patterns", "k3fusion.eager",
             "k3fusion.backend", "k3fusion.pass_manager")
    graph = import_graph(project_modules())
    bad = {m: sorted(e for e in edges if any(e == a or e.startswith(a + ".") for a in above))
           for m, edges in graph.items() if m.startswith("k3fusion.kernels")}
    assert not any(bad.values()), {m: e for m, e in bad.items() if e}


def project_imports_inside_functions(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each import of the project's own modules (``k3fusion...`` or
    relative) made inside a function with no ``#`` comment on its line or the three above:
    such an import hides a dependency, so it says why it is not at the top."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for s in ast.walk(node):
            if isinstance(s, ast.ImportFrom):
                own = s.level > 0 or (s.module or "").split(".")[0] == "k3fusion"
            elif isinstance(s, ast.Import):
                own = any(a.name.split(".")[0] == "k3fusion" for a in s.names)
            else:
                continue
            context = lines[max(0, s.lineno - 4):s.lineno]
            if own and not any("#" in line for line in context):
                found.append((s.lineno, lines[s.lineno - 1].strip()))
    return found


def test_local_project_import_check_flags_an_unexplained_one():
    bare = "def f():\n    x = 1\n    y = 2\n    z = 3\n    from .ops import rms_norm\n"
    assert project_imports_inside_functions(bare) == [(5, "from .ops import rms_norm")]
    said = "def f():\n    # circle: ops imports this module\n    from .ops import rms_norm\n"
    assert project_imports_inside_functions(said) == []
    assert project_imports_inside_functions("def f():\n    import torch\n") == []


@pytest.mark.parametrize("path", library_files() + bench_files(),
                         ids=_rel)
def test_project_imports_are_at_the_top_unless_a_comment_says_why(path):
    assert not project_imports_inside_functions(path.read_text()), _rel(path)


# ----------------------------------------------------------------------------- one list of fusions

#: Where fusion names may be listed: the registry (a fusion's own modules, named as the
#: fusion, may name it and its sub-counts too).
FUSION_LIST_HOME = "patterns/registry.py"


def fusion_names() -> set[str]:
    """Every ``match_counts()`` name, read from the patterns' ``FUSION_NAME`` /
    ``HANDOFF_NAME`` constants (statically: the rule must read code that has no registry)."""
    names = set()
    for path in (ROOT / "patterns").glob("*.py"):
        for s in ast.parse(path.read_text()).body:
            if (isinstance(s, ast.Assign) and isinstance(s.value, ast.Constant)
                    and any(isinstance(t, ast.Name) and t.id in ("FUSION_NAME", "HANDOFF_NAME")
                            for t in s.targets)):
                names.add(s.value.value)
    return names


_DISPLAYS = (ast.List, ast.Tuple, ast.Set, ast.Dict)


def fusion_lists(source: str, names: set[str]) -> list[tuple[int, list[str]]]:
    """``(line, names)`` of each outermost list / tuple / set / dict display (nested ones
    included in it) whose string constants name two fusions or more; ``__all__`` is no
    list of fusions (a function may be named as one)."""
    found = []

    def visit(node):
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return
        if isinstance(node, _DISPLAYS):
            named = sorted({n.value for n in ast.walk(node)
                            if isinstance(n, ast.Constant) and n.value in names})
            if len(named) >= 2:
                found.append((node.lineno, named))
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def test_fusion_names_are_read_from_the_patterns():
    assert fusion_names() == {"qkv_rmsnorm", "attn_res", "attn_res_delta_handoff", "moe_tail"}


def test_fusion_list_check_flags_a_second_list():
    names = {"a", "b"}
    assert fusion_lists('X = {"a": 1, "b": 2}\n', names) == [(1, ["a", "b"])]
    assert fusion_lists('X = ((\n    "a", f), ("b", g))\n', names) == [(1, ["a", "b"])]
    assert fusion_lists('__all__ = ["a", "b"]\nY = ("a", "c")\nf(x="a", y="b")\n', names) == []


def test_no_second_list_of_fusions_in_library_code():
    names = fusion_names()
    found = {}
    for p in library_files():
        rel = _rel(p)
        if rel == FUSION_LIST_HOME or p.stem in names:
            continue
        hits = fusion_lists(p.read_text(), names)
        if hits:
            found[rel] = hits
    assert not found, (f"lists of fusion names outside {FUSION_LIST_HOME} (iterate "
                       f"patterns.registry.FUSIONS instead): {found}")


# ------------------------------------------------------------------ links into the docs

#: ``docs/NAME.md#anchor`` (or ``NAME.md#anchor`` inside docs/) in code, tests and docs.
DOC_LINK = re.compile(r"\b((?:docs/)?[\w-]+\.md)#([\w-]+)")


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the headings: lower case, punctuation dropped, spaces to '-'."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+\s+(.*)$", markdown, re.MULTILINE)}


def broken_doc_links(files) -> list[tuple[str, str]]:
    docs = ROOT / "docs"
    anchors = {p.name: heading_anchors(p.read_text()) for p in docs.glob("*.md")}
    broken = []
    for path in files:
        for m in DOC_LINK.finditer(path.read_text()):
            name = Path(m.group(1)).name
            if name in anchors and m.group(2) not in anchors[name]:
                broken.append((_rel(path), m.group(0)))
    return broken


def test_heading_anchors_are_githubs():
    headings = "## `kernels/attn_res.py`\n### 2026-12-03: the block count; PDL (issue 30)\n"
    assert heading_anchors(headings) == {"kernelsattn_respy",
                                         "2026-12-03-the-block-count-pdl-issue-30"}


def test_links_into_the_docs_name_headings_that_exist():
    """A renamed heading breaks every ``docs/x.md#anchor`` that pointed at it (a library
    constant's one line to its benchmark included)."""
    files = (library_files() + bench_files() + sorted((ROOT / "tests").glob("*.py"))
             + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"])
    assert not broken_doc_links(files)


def test_each_test_starts_from_its_own_global_seed(request):
    """conftest seeds torch's global RNG per test id, so default-initialized weights do not
    depend on which tests ran before in the worker."""
    import zlib

    import torch

    drawn = torch.rand(3)
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    assert torch.equal(drawn, torch.rand(3))
