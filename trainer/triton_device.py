"""Where this process can run the trainer's Triton kernels (the decoder's row-invariant ops, the fused CE, the FP8
target's SwiGLU quantization): CUDA, or CPU tensors under Triton's interpreter, which only the kernel tests switch on.
Pure and light: no triton import."""
from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def interpreting() -> bool:
    """Triton's CPU interpreter is on. It must be chosen before triton is imported (the CPU tests do so)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# Under the interpreter the kernels can take CPU tensors, slowly. Only the kernel tests switch this on; everything else
# on CPU keeps the torch forms (HF modules, SDPA, Inductor's CE).
CPU_UNDER_INTERPRETER = False


def runs_on(device: torch.device) -> bool:
    """Triton kernels can run on tensors of `device` here: CUDA, or CPU under the interpreter (the kernel tests)."""
    return device.type == "cuda" or (device.type == "cpu" and CPU_UNDER_INTERPRETER and interpreting())


def shared_memory_limit(device: torch.device) -> float:
    """The shared memory one program may ask of an SM of `device`, in bytes: the opt-in maximum that Triton checks a
    launch against (an SM's less the 1 KB CUDA reserves a block, where torch does not report it; H100/H200 232,448,
    A100 166,912, a 99 KB SM such as an RTX 4090's 101,376); unbounded on CPU (the interpreter)."""
    if device.type != "cuda":
        return float("inf")
    import torch

    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", None) or props.shared_memory_per_multiprocessor - 1024


def triton_kernels(build):
    """Decorator: `build(triton, tl)` -> the module's jitted kernels, run once, on the first call of the decorated
    name, where Triton imports; None where it does not. So importing a module that declares kernels costs nothing
    where none runs."""

    @functools.lru_cache(maxsize=1)
    def built():
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return build(triton, tl)

    built.__doc__ = build.__doc__
    return built
