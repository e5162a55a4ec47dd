"""RoPE math shared by every longpeft method.

Conventions (those of transformers' Llama family): a head vector of size ``head_dim`` is split
in two halves; frequency ``j`` (``0 <= j < head_dim / 2``) rotates the pair ``(x[j], x[j + head_dim/2])``
by ``position * inv_freq[j]`` radians.

It also holds the one correct way to change the RoPE parameters of a built transformers v5 model
(:func:`set_rope_parameters`; assigning ``config.rope_theta`` is silently ignored in v5).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .base_config import rope_parameters_of, validate_rope_parameters
from .errors import ConfigError, LongpeftError
from .family import head_dim_of


def inv_freq(base: float, head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies of standard RoPE.

    Computed exactly as transformers' default RoPE does (float32 ``arange``), so that a model
    patched by longpeft with the model's own base is bit-identical to the unpatched one.

    Returns:
        float32 tensor of shape ``[head_dim // 2]``, radians per position.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    if base <= 1:
        raise ValueError(f"RoPE base must be > 1, got {base}")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
    return 1.0 / (base**exponents)


def per_head_inv_freq(bases: Sequence[float], head_dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies for one RoPE base per head.

    Returns:
        float32 tensor of shape ``[len(bases), head_dim // 2]``; row ``h`` equals ``inv_freq(bases[h])``.
    """
    if len(bases) == 0:
        raise ValueError("per_head_inv_freq needs at least one base")
    return torch.stack([inv_freq(float(b), head_dim, device) for b in bases])


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` on the last axis (the two halves of a head vector)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by the angles whose cosines and sines are given.

    Args:
        x: ``[..., head_dim]`` (e.g. ``[batch, heads, seq, head_dim]``).
        cos, sin: broadcastable to ``x`` (e.g. ``[batch, 1, seq, head_dim]`` for one base,
            ``[batch, heads, seq, head_dim]`` for one base per head).
    """
    return x * cos + rotate_half(x) * sin


def rotate_per_head(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate query or key heads with the cos/sin of their KV head (one RoPE base per KV head).

    Args:
        x: ``[batch, heads, seq, head_dim]`` with ``heads`` a multiple of ``kv_heads`` (query head
            ``h`` belongs to KV head ``h // (heads // kv_heads)``, transformers' ``repeat_kv`` order).
        cos, sin: ``[batch, kv_heads, seq, head_dim]``.
    """
    batch, heads, seq, head_dim = x.shape
    kv_heads = cos.shape[1]
    grouped = x.view(batch, kv_heads, heads // kv_heads, seq, head_dim)
    return apply_rotary(grouped, cos[:, :, None], sin[:, :, None]).view(batch, heads, seq, head_dim)


def cos_sin(
    position_ids: torch.Tensor, frequencies: torch.Tensor, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of ``position * frequency``, duplicated over both halves of a head.

    Args:
        position_ids: integer or float positions, ``[batch, seq]``.
        frequencies: ``[head_dim // 2]`` (one base) or ``[heads, head_dim // 2]`` (one base per head).
        dtype: dtype of the returned tensors (the angles are always computed in float32).

    Returns:
        ``(cos, sin)``, each ``[batch, seq, head_dim]`` for one base or ``[batch, heads, seq, head_dim]``
        for one base per head.
    """
    positions = position_ids.to(torch.float32)
    frequencies = frequencies.to(device=positions.device, dtype=torch.float32)
    if frequencies.dim() == 1:
        angles = positions[..., None] * frequencies  # [B, T, D/2]
    elif frequencies.dim() == 2:
        angles = positions[:, None, :, None] * frequencies[None, :, None, :]  # [B, H, T, D/2]
    else:
        raise ValueError(f"frequencies must be [D/2] or [heads, D/2], got shape {tuple(frequencies.shape)}")
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


# --------------------------------------------------------------------------------------------
# Changing the RoPE parameters of a built model (transformers v5).
# --------------------------------------------------------------------------------------------


def rotary_modules(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """All rotary embedding modules of a model as ``(parent, attribute_name, module)``.

    A rotary module is recognised by its ``inv_freq`` buffer and ``rope_type`` attribute.
    """
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if hasattr(child, "inv_freq") and hasattr(child, "rope_type"):
                found.append((parent, name, child))
    return found


def set_rope_parameters(
    model: nn.Module, rope_parameters: dict[str, Any], max_position_embeddings: int | None = None
) -> torch.Tensor:
    """Give a built transformers model new RoPE parameters, the v5-correct way.

    Writes the complete dict into ``config.rope_parameters`` (and ``max_position_embeddings`` when
    given), rebuilds every rotary module from the config, and verifies that the rotary module's
    ``inv_freq`` equals what the new parameters imply.

    Args:
        model: a transformers causal LM (or its inner model); a PEFT wrapper also works.
        rope_parameters: complete dict, e.g. ``{"rope_type": "default", "rope_theta": 2e8}``.
        max_position_embeddings: new context length to record in the config (and for rope types
            that read it).

    Returns:
        The new ``inv_freq`` (``[head_dim // 2]``).
    """
    params = validate_rope_parameters(copy.deepcopy(dict(rope_parameters)))
    rotaries = rotary_modules(model)
    if not rotaries:
        raise ConfigError(f"{type(model).__name__} has no rotary embedding module; is it a RoPE model?")
    configs = {id(m.config): m.config for _, _, m in rotaries}
    top_config = getattr(model, "config", None)  # transformers reads it too (e.g. when saving): keep it consistent
    if top_config is not None:
        configs.setdefault(id(top_config), top_config)
    for config in configs.values():
        config.rope_parameters = copy.deepcopy(params)
        if max_position_embeddings is not None:
            config.max_position_embeddings = int(max_position_embeddings)
    for parent, name, old in rotaries:
        new = type(old)(config=old.config).to(old.inv_freq.device)
        setattr(parent, name, new)
        expected_type = params.get("rope_type", "default")
        if new.rope_type != expected_type:
            raise RuntimeError(f"rotary module kept rope_type {new.rope_type!r}, expected {expected_type!r}")
        if expected_type == "default":
            # transformers computes inv_freq on the CPU and moves it; the device's pow may round the last bit
            # differently, so compare on the CPU to float32 precision (a base that did not change is far off)
            expected = inv_freq(float(params["rope_theta"]), new.inv_freq.numel() * 2)
            if not torch.allclose(new.inv_freq.float().cpu(), expected, rtol=1e-6, atol=0):
                raise RuntimeError("rotary inv_freq did not change to the requested rope_theta")
    return new.inv_freq  # the last rotary module's (there is at least one)


# --------------------------------------------------------------------------------------------
# Checking the rotary frequencies of a model built by someone else (e.g. unsloth).
# --------------------------------------------------------------------------------------------


class RotaryMismatch(LongpeftError, ValueError):
    """A built model's rotary frequencies are not the ones its config's rope_parameters imply (a library that built
    it changed them: the message says which and what to do)."""


def expected_rotary(config: Any) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` that transformers computes for the config's ``rope_parameters``.

    float32 on CPU; ``default`` through :func:`inv_freq`, the other rope types through transformers'
    own ``ROPE_INIT_FUNCTIONS``.
    """
    params = validate_rope_parameters(rope_parameters_of(config))
    if params["rope_type"] == "default":
        dim = int(head_dim_of(config) * float(params.get("partial_rotary_factor", 1.0)))
        return inv_freq(float(params["rope_theta"]), dim), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    frequencies, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    return frequencies.float().cpu(), float(scaling)


def effective_frequencies(module: nn.Module) -> torch.Tensor:
    """Radians per position of a rotary module: its ``inv_freq`` divided by the position scale of
    modules that scale positions instead of frequencies (unsloth's linear "kaiokendev" rotary keeps
    ``inv_freq`` and divides the positions by ``scaling_factor``)."""
    scale = getattr(module, "scaling_factor", None)
    frequencies = module.inv_freq.detach().float().cpu()
    return frequencies / float(scale) if isinstance(scale, (int, float)) and scale else frequencies


def check_rotary_frequencies(model: nn.Module, config: Any, rtol: float = 1e-5) -> torch.Tensor:
    """Verify that every rotary module of ``model`` (any module with an ``inv_freq`` buffer) rotates
    exactly as ``config.rope_parameters`` says: same frequencies and no extra attention scaling.

    Returns:
        The expected ``inv_freq``.

    Raises:
        RotaryMismatch: naming the module, the largest relative difference, and the frequency ratio
            (a ratio of 1/f everywhere is a linear scaling by f stacked on top of the requested RoPE).
    """
    expected, scaling = expected_rotary(config)
    found = {
        id(m): (name, m) for name, m in model.named_modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)
    }
    if not found:
        raise RotaryMismatch(f"{type(model).__name__} has no rotary module with an inv_freq buffer to check")
    wanted = f"rope_parameters {rope_parameters_of(config)}"
    for name, module in found.values():
        actual = effective_frequencies(module)
        if actual.shape != expected.shape:
            raise RotaryMismatch(
                f"{name or 'model'}: {actual.numel()} rotary frequencies, {wanted} gives {expected.numel()}"
            )
        difference = ((actual - expected).abs() / expected).max().item()
        if difference > rtol:
            ratio = (actual / expected).median().item()
            raise RotaryMismatch(
                f"{name or 'model'}: rotary frequencies differ from {wanted} by up to {difference:.3g} (relative; "
                f"median ratio {ratio:.4g}, i.e. positions scaled by {1 / ratio:.4g})"
            )
        module_scaling = getattr(module, "attention_scaling", 1.0)
        tolerance = rtol * max(1.0, scaling)
        if isinstance(module_scaling, (int, float)) and abs(float(module_scaling) - scaling) > tolerance:
            raise RotaryMismatch(f"{name or 'model'}: attention scaling {module_scaling}, {wanted} gives {scaling}")
    return expected
