"""Compile GPU-only kernel code for Hopper (sm_90) on any machine, outside the Triton
interpreter: how CPU tests check code the interpreter never builds (barriers, fences,
tensor-core dots)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

__all__ = ["run_compile_script", "hopper_ptx", "hopper_ptxs", "assert_pdl_order"]

#: printed between the PTX of two compiles of one script (one interpreter start, about 2 s
#: of importing torch and triton, for several compiles)
SEPARATOR = "//// next compile ////"


def run_compile_script(script: str, what: str, timeout_s: float = 300.0) -> str:
    """Run ``script`` (Python that compiles with ``triton.compile`` and prints what the test
    checks) in a fresh interpreter without ``TRITON_INTERPRET``; its stdout. Skips when
    this triton has no ptxas; fails with the script's stderr otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"compiling {what} for sm_90 took over {timeout_s:.0f} s")
    if done.returncode != 0 and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("this triton has no ptxas")
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def hopper_ptx(kernel: str, what: str, const: dict, *, pointers: dict | None = None,
               num_warps: int = 4) -> str:
    """The sm_90 PTX of ``kernel`` (``"module:name"``) with the constexprs ``const``
    (ints and bools). Other parameters: ``pointers[name]`` where given, else ``*bf16`` for
    ``*_ptr``, fp32 for ``*eps``, i32 for the rest (no alignment hints)."""
    return hopper_ptxs(kernel, what, [const], pointers=pointers, num_warps=num_warps)[0]


def hopper_ptxs(kernel: str, what: str, consts: list[dict], *, pointers: dict | None = None,
                num_warps: int = 4) -> list[str]:
    """:func:`hopper_ptx` for each constexpr set of ``consts``, compiled one after the
    other in one fresh interpreter; the PTX in the same order."""
    module, name = kernel.split(":")
    script = f"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from {module} import {name} as k
pointers = {pointers or {}!r}
names = [p.name for p in k.params]
for i, const in enumerate({list(consts)!r}):
    sig = {{n: "constexpr" if n in const else pointers[n] if n in pointers
           else "*bf16" if n.endswith("_ptr") else "fp32" if n.endswith("eps") else "i32"
           for n in names}}
    src = ASTSource(fn=k, signature=sig,
                    constexprs={{(names.index(n),): v for n, v in const.items()}})
    if i:
        print({SEPARATOR!r})
    print(triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={{"num_warps": {num_warps}}}).asm["ptx"])
"""
    ptxs = run_compile_script(script, what).split(SEPARATOR + "\n")
    assert len(ptxs) == len(consts), (what, len(ptxs), len(consts))
    return ptxs


def assert_pdl_order(ptx: str, pdl: bool, late_trigger: bool = False,
                     mix_trigger: bool = False) -> None:
    """A ``PDL`` form waits for the previous launch (griddepcontrol.wait) before any global
    load, then lets the next launch start -- at once, with ``late_trigger`` after its last
    global store, with ``mix_trigger`` as well between its first and its last (the
    AttnRes kernels: after the prefix update, before the output); without PDL neither
    instruction is there."""
    lines = [x.strip() for x in ptx.splitlines()]
    at = [i for i, x in enumerate(lines) if "griddepcontrol.wait" in x]
    go = [i for i, x in enumerate(lines) if "griddepcontrol.launch_dependents" in x]
    loads = [i for i, x in enumerate(lines) if "ld.global" in x]
    stores = [i for i, x in enumerate(lines) if "st.global" in x]
    if pdl and mix_trigger:
        assert len(at) == 1 and len(go) == 1 and at[0] < min(loads), (at, loads[:1])
        assert min(stores) < go[0] < max(stores), (go, stores[:1], stores[-1:])
    elif pdl and late_trigger:
        assert len(at) == 1 and len(go) == 1 and at[0] < min(loads), (at, loads[:1])
        assert go[0] > max(stores), (go, stores[-1:])
    elif pdl:
        assert len(at) == 1 and len(go) == 1 and at[0] < go[0] < min(loads), (at, go)
    else:
        assert not at and not go
