"""STRING (An et al., 2024): training-free shifted query positions for far keys at inference.

``enable_string(model)`` / ``disable_string(model)`` switch it on a built model (its settings show in
``print(model)``); a ``string`` section (:class:`StringConfig`) switches it on when an adapter is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..registry import Method, imported_on_call, torch_names
from .config import DEFAULT_LOCAL_WINDOW, StringConfig, describe, resolve, string_defaults

if TYPE_CHECKING:  # registering the method imports no torch
    from torch import nn

TORCH_NAMES = {
    **dict.fromkeys(("STRING_ATTENTION", "StringSettings", "disable_string", "install_string"), "attention"),
    **dict.fromkeys(("rotate_keys_forward", "string_attention_eager", "string_attention_flash"), "attention"),
    **dict.fromkeys(("string_attention_forward", "string_attention_sdpa", "string_settings"), "attention"),
    **dict.fromkeys(("enable_string", "is_string_on", "recorded_trained_length"), "patch"),
    "write_remote_code": "export",
}
__getattr__ = torch_names(__name__, TORCH_NAMES)


class String(Method):
    """STRING in the registry: on a built model at inference only, bounding the positions an input spans."""

    name = "string"
    config = StringConfig
    remote_code = True
    inference_only = True
    conflicts = {
        "harpe": "STRING needs one RoPE base for all heads, and HARPE gives each head its own",
        "beacon": "Activation Beacon keeps positions inside the base's window already, and its cache holds beacon "
        "keys whose positions are not their cache indices (STRING reads distances off those)",
        "liger_kernels": "its attention forward rotates queries and keys itself (shifted positions for far keys), "
        "where Liger's RoPE kernel does not reach, and the pair is not checked",
        "unsloth": "unsloth replaces the attention forward that STRING patches, which would silently not apply",
    }

    resolve = staticmethod(resolve)
    describe = staticmethod(describe)
    remove = imported_on_call(f"{__name__}.attention", "disable_string")
    is_applied = imported_on_call(f"{__name__}.patch", "is_string_on")
    model_span = imported_on_call(f"{__name__}.patch", "model_span")

    def apply(self, model: nn.Module, config: StringConfig) -> None:
        from .patch import enable_string

        enable_string(model, **config.model_dump())

    def export(self, model: nn.Module, folder: Path, config: StringConfig) -> None:
        from .attention import StringSettings
        from .export import write_remote_code

        write_remote_code(folder, StringSettings(**config.model_dump()))


METHOD = String()

__all__ = ["DEFAULT_LOCAL_WINDOW", "METHOD", "StringConfig", "string_defaults", *TORCH_NAMES]
