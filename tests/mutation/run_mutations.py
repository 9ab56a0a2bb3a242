"""Mutation check of one module: put single-line bugs into it one at a time, run the test
files that should catch them, and report which survived.

    PYTHONPATH=$PWD python tests/mutation/run_mutations.py patterns/moe_tail.py \\
        tests/test_moe_tail_pass.py tests/test_moe_tail_mutations.py --max 15 --seed 0

Mutants (each a realistic one-line bug, generated from the module's own lines):

* ``guard``: ``if <cond>:`` -> ``if False and (<cond>):`` -- a check removed (the kind of
  bug a refactor introduces: a near miss stops being refused);
* ``negate``: ``==`` <-> ``!=``, `` is `` <-> `` is not ``, `` in `` <-> `` not in ``;
* ``boundary``: ``<`` <-> ``<=``, ``>`` <-> ``>=``;
* ``bool``: ``True`` <-> ``False`` in an expression; ``and`` <-> ``or``;
* ``constant``: an integer literal ``n`` -> ``n + 1``.

Lines in docstrings and comments are skipped, and so are mutants that do not compile.
``--max`` draws that many mutants (reproducibly, by ``--seed``) from all candidates;
``--list`` prints the candidates without running anything. The module file is restored
after every mutant (also on Ctrl-C). Each mutant runs ``pytest -x -q`` on the given test
files (one failing test kills it); the run's score is killed / run. A survivor is a bug
the tests let through -- or an equivalent mutant (same behaviour), to be judged by hand.

Keep it targeted: 2 CPU cores run ~10-20 mutants of one module against its own test files
in 10-30 minutes (the slowest test file sets the pace of each survivor).
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import random
import re
import subprocess
import sys
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

SWAPS = [
    ("negate", r" == ", " != "), ("negate", r" != ", " == "),
    ("negate", r" is not ", " is "), ("negate", r" is (?!not )", " is not "),
    ("negate", r" not in ", " in "), ("negate", r"(?<!not) in (?=\w)", " not in "),
    ("boundary", r" < ", " <= "), ("boundary", r" <= ", " < "),
    ("boundary", r" > ", " >= "), ("boundary", r" >= ", " > "),
    ("bool", r"\bTrue\b", "False"), ("bool", r"\bFalse\b", "True"),
    ("bool", r" and ", " or "), ("bool", r" or ", " and "),
]


@dataclass
class Mutant:
    line: int          # 1-based
    kind: str
    before: str
    after: str

    def __str__(self) -> str:
        return f"L{self.line} {self.kind}: {self.before.strip()}  ->  {self.after.strip()}"


def _code_lines(source: str) -> set[int]:
    """Line numbers holding code (not docstrings)."""
    tree = ast.parse(source)
    doc = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(getattr(body[0], "value", None), ast.Constant) \
                and isinstance(body[0].value.value, str):
            doc.update(range(body[0].lineno, body[0].end_lineno + 1))
    return set(range(1, len(source.splitlines()) + 1)) - doc


def _masked_lines(source: str) -> list[str]:
    """The source's lines with string literals and comments blanked (same columns), so
    that mutations only touch code."""
    lines = source.splitlines(keepends=True)
    masked = [list(line) for line in lines]
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.STRING, tokenize.COMMENT) and \
                tok.type != getattr(tokenize, "FSTRING_MIDDLE", -1):
            continue
        (r0, c0), (r1, c1) = tok.start, tok.end
        for r in range(r0, r1 + 1):
            row = masked[r - 1]
            lo = c0 if r == r0 else 0
            hi = c1 if r == r1 else len(row)
            for c in range(lo, hi):
                if row[c] != "\n":
                    row[c] = "_"
    return ["".join(row) for row in masked]


def candidates(source: str) -> list[Mutant]:
    lines = source.splitlines(keepends=True)
    masked = _masked_lines(source)
    out = []
    for no in sorted(_code_lines(source)):
        text = lines[no - 1]
        code = masked[no - 1]
        if not code.strip() or code.lstrip().startswith(("import", "from", "def ", "class ",
                                                           "@", "__all__")):
            continue
        m = re.match(r"^(\s*)(el)?if (.*):\s*$", code.rstrip("_ \n"))
        if m:
            cond = text[m.start(3):m.end(3)]
            out.append(Mutant(no, "guard", text,
                              f"{m.group(1)}{m.group(2) or ''}if False and ({cond}):\n"))
        for kind, pattern, repl in SWAPS:
            for hit in re.finditer(pattern, code):
                after = text[:hit.start()] + repl + text[hit.end():]
                out.append(Mutant(no, kind, text, after))
        for hit in re.finditer(r"(?<![\w.])(\d+)(?![\w.])", code):
            n = int(hit.group(1))
            after = text[:hit.start()] + str(n + 1) + text[hit.end():]
            out.append(Mutant(no, "constant", text, after))
    valid = []
    for mut in out:
        trial = lines[:]
        trial[mut.line - 1] = mut.after
        try:
            compile("".join(trial), "<mutant>", "exec")
        except SyntaxError:
            continue
        valid.append(mut)
    return valid


def run(module: Path, tests: list[str], mutants: list[Mutant], timeout: float) -> list[tuple]:
    original = module.read_text()
    lines = original.splitlines(keepends=True)
    results = []
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    try:
        for i, mut in enumerate(mutants, 1):
            trial = lines[:]
            trial[mut.line - 1] = mut.after
            module.write_text("".join(trial))
            start = time.monotonic()
            try:
                proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p",
                                       "no:cacheprovider", *tests], env=env,
                                      capture_output=True, text=True, timeout=timeout)
                killed = proc.returncode != 0
                how = "killed" if killed else "SURVIVED"
                if killed:
                    failed = [l for l in proc.stdout.splitlines() if l.startswith("FAILED")]
                    how += f" ({failed[0][7:90]})" if failed else f" (rc {proc.returncode})"
            except subprocess.TimeoutExpired:
                killed, how = True, "killed (timeout)"
            secs = time.monotonic() - start
            print(f"[{i}/{len(mutants)}] {how:<60.60} {secs:5.0f}s  {mut}", flush=True)
            results.append((mut, killed, how))
    finally:
        module.write_text(original)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("module", type=Path)
    ap.add_argument("tests", nargs="*")
    ap.add_argument("--max", type=int, default=15, help="mutants to run (drawn by --seed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default="guard,negate,boundary,bool,constant")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant")
    ap.add_argument("--list", action="store_true", help="print the candidates and exit")
    args = ap.parse_args(argv)
    kinds = set(args.kinds.split(","))
    pool = [m for m in candidates(args.module.read_text()) if m.kind in kinds]
    if args.list:
        for m in pool:
            print(m)
        print(f"{len(pool)} candidates")
        return 0
    if not args.tests:
        ap.error("give the test files to run")
    chosen = sorted(random.Random(args.seed).sample(pool, min(args.max, len(pool))),
                    key=lambda m: m.line)
    results = run(args.module, args.tests, chosen, args.timeout)
    killed = sum(k for _, k, _ in results)
    print(f"\nscore: {killed}/{len(results)} killed ({args.module}, seed {args.seed}, "
          f"{len(pool)} candidates); survivors:")
    for mut, k, _ in results:
        if not k:
            print(f"  {mut}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
