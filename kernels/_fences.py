"""Memory fences for kernels whose programs exchange data through global memory (PTX:
NVIDIA GPUs only, never traced under Triton's interpreter -- callers keep them behind a
constexpr switch). Each thread fences its own earlier stores, then the caller's CTA
barrier and one thread's release atomic publish them."""

import triton
import triton.language as tl


@triton.jit
def fence_gpu():
    # Earlier stores visible GPU-wide (release) / later loads ordered after what other
    # programs released (acquire).
    tl.inline_asm_elementwise("fence.acq_rel.gpu;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)


@triton.jit
def fence_system():
    # The same at system scope: peers on other GPUs read the stores over NVLink.
    tl.inline_asm_elementwise("fence.acq_rel.sys;", "=r", [], dtype=tl.int32, is_pure=False,
                              pack=1)
