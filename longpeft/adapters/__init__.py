"""Context-extension methods. Each module is usable on its own; ``apply_spec`` applies a whole
:class:`~longpeft.spec.ContextSpec` (the non-weight part of an adapter) to a built model."""

from __future__ import annotations

from torch import nn

from ..spec import ContextSpec
from .rope_base import expand_rope_base


def apply_spec(model: nn.Module, spec: ContextSpec) -> None:
    """Give ``model`` every non-weight change recorded in ``spec``, in place.

    Order: RoPE parameters and max length, then per-head bases (HARPE), then STRING.
    Raises SpecMismatchError (via ``spec.check_base``) before changing anything when the model
    is not the base the spec was made for.
    """
    spec.check_base(model.config)
    expand_rope_base(model, spec.rope_parameters, spec.max_position_embeddings)
    if spec.head_bases:
        from .harpe import apply_head_bases

        apply_head_bases(model, spec.head_bases)
    if spec.string:
        from .string import enable_string

        enable_string(model, **spec.string)
    if spec.beacon:
        raise NotImplementedError(
            "this longpeft version cannot load Activation Beacon adapters (longpeft.json has a 'beacon' section)"
        )


__all__ = ["apply_spec", "expand_rope_base"]
