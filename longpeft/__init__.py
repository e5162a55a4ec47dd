"""longpeft: parameter-efficient context extension for Hugging Face causal LMs.

``longpeft.load(base, adapter_dir)`` loads an adapter onto a base (:func:`longpeft.loading.load`). Importing the
package is cheap: torch and transformers load when a public name is first used.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

__version__ = "0.1.0"

# bitsandbytes' CPU backend (AVX512-BF16 CPUs) warns on every import that it cannot fetch an optional 4-bit kernel
# from the Hub, then uses its own (the one longpeft is tested with): that one record is dropped.
BNB_OPTIONAL_KERNEL_NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community"
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith(BNB_OPTIONAL_KERNEL_NOTICE)
)

# DeepSpeed (imported by accelerate on a first save_pretrained) warns on stdout, breaking a command's JSON output, that
# it set the accelerator to CPU: that record is dropped where torch sees no CUDA device either.
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
