"""HARPE: one RoPE base per key/value head ("Breaking the Stage Barrier", Lian et al.), the query heads of a group
using their KV head's. The bases are chosen when the adapter is created (:func:`resolve`), applied to the model
(``apply_head_bases``) and recorded in ``longpeft.json``; the model trains at the target length in one stage."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...family import head_dim_of, num_kv_heads
from ..registry import Method, ResolveContext, imported_on_call, torch_names
from .config import HarpeConfig, check_head_bases, describe

if TYPE_CHECKING:  # registering the method imports no torch
    from torch import nn

TORCH_NAMES = {
    **dict.fromkeys(("apply_head_bases", "has_head_bases", "is_harpe_on", "remove_head_bases"), "patch"),
    **dict.fromkeys(("peak_valley_bases", "select_bases", "uniform_bases"), "selection"),
    "write_remote_code": "export",
}
__getattr__ = torch_names(__name__, TORCH_NAMES)


def resolve(config: HarpeConfig, context: ResolveContext) -> HarpeConfig:
    """Choose one base per KV head of the base model (kept when the config already has them)."""
    base = context.base_config
    if config.bases is not None:
        return config.model_copy(update={"bases": check_head_bases(base, config.bases)})
    from .selection import select_bases  # the peak-valley search computes RoPE waveforms in torch

    shape = {"n": num_kv_heads(base), "head_dim": head_dim_of(base), "target_length": context.target_length}
    bases = select_bases(**config.model_dump(exclude={"bases"}), **shape)  # and the section's settings
    return config.model_copy(update={"bases": bases})


class Harpe(Method):
    """HARPE in the registry: bases chosen when an adapter is created, set on a built model, shipped on export."""

    name = "harpe"
    config = HarpeConfig
    remote_code = True
    conflicts = {
        "liger_kernels": "its attention forward rotates queries and keys itself (one RoPE base per head), where "
        "Liger's RoPE kernel does not reach, and the pair is not checked",
        "unsloth": "unsloth replaces the attention forward that rotates with HARPE's per-head bases, which would "
        "silently not apply",
    }

    resolve = staticmethod(resolve)
    describe = staticmethod(describe)
    remove = imported_on_call(f"{__name__}.patch", "remove_head_bases")
    is_applied = imported_on_call(f"{__name__}.patch", "is_harpe_on")

    def apply(self, model: nn.Module, config: HarpeConfig) -> None:
        from .patch import apply_head_bases

        apply_head_bases(model, config.chosen_bases())

    def export(self, model: nn.Module, folder: Path, config: HarpeConfig) -> None:
        from .export import write_remote_code

        write_remote_code(folder, config.chosen_bases())


METHOD = Harpe()

__all__ = ["METHOD", "HarpeConfig", "check_head_bases", *TORCH_NAMES]
