"""The decoder layers' MLP tiled along the sequence (``train.mlp_tile_tokens``).

A Llama-style MLP treats every token on its own, and its backward keeps ``[batch, seq, intermediate]`` tensors, the
largest activations of a recomputed layer at long lengths. Tiled, its forward keeps only its input
``x [batch, seq, hidden]``, and its backward runs each tile's forward again and then its backward: one tile's
intermediates exist at a time. The results equal the untiled MLP's up to the order of floating-point sums. An
input that needs no gradient runs untiled.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .checkpointing import decoder_layers


class _SaveInput(torch.autograd.Function):
    """The identity, saving its input for the tiled MLP's backward before the tiles run: a checkpoint's recompute
    stops at this save (torch's early stop: the MLP is the last op of its layer that saves a tensor), so the tiles
    do not run a third time."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _TiledMLP(torch.autograd.Function):
    """``forward(x)`` over sequence tiles, for ``x`` that :class:`_SaveInput` returned; the trained parameters are
    inputs so that data-parallel reducers see each one's gradient ready once per backward."""

    @staticmethod
    def forward(ctx: Any, forward: Any, tile_tokens: int, x: torch.Tensor, *parameters: torch.Tensor) -> torch.Tensor:
        ctx.saved_input = x.grad_fn  # the _SaveInput node that holds x
        ctx.forward, ctx.tile_tokens, ctx.parameters = forward, tile_tokens, parameters
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        with torch.no_grad():
            tiles = [forward(x[:, start : start + tile_tokens]) for start in range(0, x.shape[1], tile_tokens)]
        return torch.cat(tiles, dim=1)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_input.saved_tensors
        device, autocast_enabled, autocast_dtype = ctx.autocast
        grad_x = torch.empty_like(x)
        grad_parameters: list[torch.Tensor | None] = [None] * len(ctx.parameters)
        for start in range(0, x.shape[1], ctx.tile_tokens):
            stop = start + ctx.tile_tokens
            with torch.enable_grad(), torch.autocast(device, dtype=autocast_dtype, enabled=autocast_enabled):
                tile = x[:, start:stop].detach().requires_grad_(True)
                output = ctx.forward(tile)
            grads = torch.autograd.grad(output, [tile, *ctx.parameters], grad_output[:, start:stop], allow_unused=True)
            grad_x[:, start:stop] = grads[0]
            for index, grad in enumerate(grads[1:]):
                if grad is not None:
                    grad_parameters[index] = grad if grad_parameters[index] is None else grad_parameters[index] + grad
        return (None, None, grad_x, *grad_parameters)


class TiledMLPForward:
    """Replaces an MLP module's ``forward``: tiles of ``tile_tokens`` tokens when gradients are on and the
    input is longer than one tile; the module's own forward otherwise."""

    def __init__(self, mlp: nn.Module, tile_tokens: int) -> None:
        self.mlp, self.tile_tokens = mlp, tile_tokens
        self.replaced = mlp.__dict__.get("forward")  # an instance-level forward (a fused kernel's), or None
        self.forward = mlp.forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # without gradients to x there is no backward to tile (and no _SaveInput node to hold x)
        if not (torch.is_grad_enabled() and x.requires_grad) or x.dim() != 3 or x.shape[1] <= self.tile_tokens:
            return self.forward(x)
        parameters = [p for p in self.mlp.parameters() if p.requires_grad]
        return _TiledMLP.apply(self.forward, self.tile_tokens, _SaveInput.apply(x), *parameters)


def apply_tiled_mlp(model: nn.Module, tile_tokens: int) -> int:
    """Tile every decoder layer's MLP of ``model`` along the sequence, ``tile_tokens`` tokens at a time, in place;
    returns the number of MLPs tiled."""
    if tile_tokens < 1:
        raise ConfigError(f"train.mlp_tile_tokens must be >= 1, got {tile_tokens}")
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(f"{type(model).__name__} has no decoder layers whose MLP could be tiled")
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module):
            raise ConfigError(
                f"train.mlp_tile_tokens: the decoder layer {type(layer).__name__} has no `mlp` module to tile"
            )
        mlp.forward = TiledMLPForward(mlp, tile_tokens)
    return len(layers)


def remove_tiled_mlp(model: nn.Module) -> None:
    """Undo :func:`apply_tiled_mlp`: every MLP runs its own forward again."""
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        tiled = getattr(mlp, "forward", None)
        if isinstance(tiled, TiledMLPForward):
            if tiled.replaced is None:
                del mlp.forward
            else:
                mlp.forward = tiled.replaced


def is_tiled(model: nn.Module) -> bool:
    """Whether :func:`apply_tiled_mlp` is active on ``model``."""
    return any(
        isinstance(getattr(getattr(layer, "mlp", None), "forward", None), TiledMLPForward)
        for layer in decoder_layers(model)
    )
