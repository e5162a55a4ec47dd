"""longpeft: parameter-efficient context extension for Hugging Face causal LMs.

``longpeft.load(base, adapter_dir)`` loads an adapter onto a base model (its ``longpeft.json``
first, then the weights; see :func:`longpeft.loading.load`). Importing the package is cheap: torch
and transformers load when ``load``, ``ContextSpec`` or ``SpecMismatchError`` is first used. Every error
longpeft raises for input it cannot use is a ``LongpeftError`` (the kinds: :mod:`longpeft.errors`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"

# bitsandbytes' CPU backend, on CPUs with AVX512-BF16, tries to fetch an optional faster 4-bit matmul from the
# Hub through the `kernels` package at import, and logs a warning on every import when it cannot (package
# absent, or no network), then uses its own CPU kernel: the one longpeft's 4-bit CPU paths are tested with.
# That one notice reads like a failure in every CPU command's output, so it is dropped; the logger's other
# records pass.
BNB_OPTIONAL_KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"


def _not_bnb_optional_kernel_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(BNB_OPTIONAL_KERNEL_NOTICE)


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_not_bnb_optional_kernel_notice)

# DeepSpeed, imported by accelerate on the first save_pretrained of a process when it is installed, probes for an
# accelerator and on a machine without one warns "Setting accelerator to CPU. If you have GPU or other accelerator,
# we were unable to detect it." on stdout (breaking a command's JSON output). Where torch sees no CUDA device
# either, CPU is what the run uses knowingly, so that record is dropped; with a CUDA device the warning passes.
DEEPSPEED_CPU_NOTICE = "Setting accelerator to CPU"


def _not_deepspeed_cpu_notice(record: logging.LogRecord) -> bool:
    if not str(record.msg).startswith(DEEPSPEED_CPU_NOTICE):
        return True
    import torch  # imported already: DeepSpeed imports it first

    return torch.cuda.device_count() > 0


logging.getLogger("DeepSpeed").addFilter(_not_deepspeed_cpu_notice)

# Public name -> the submodule that defines it (the object itself is returned: real signature and docs).
_EXPORTS = {"load": "loading", "ContextSpec": "spec", "SpecMismatchError": "spec", "LongpeftError": "errors"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'longpeft' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = ["ContextSpec", "LongpeftError", "SpecMismatchError", "load", "__version__"]
