"""Activation checkpointing that keeps what memory allows and offloads what it must.

Three levers on a checkpointed decoder layer (which keeps only its input ``[batch, seq, hidden]`` and runs its
forward again in the backward), each with the same losses and gradients as checkpointing every layer:
``checkpointed`` (only the first N layers are checkpointed, the others keep every activation), ``keep_attention``
(the first K checkpointed layers save the attention kernel's outputs through torch's selective checkpointing, so
their recompute skips the attention forward) and ``offload`` (the checkpointed layers' inputs wait in pinned CPU
memory, copied on side streams; the last one stays on the GPU). :func:`apply_checkpointing` installs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..errors import ConfigError

# Attention kernels whose outputs ``keep_attention`` saves: torch's SDPA backends (CPU, flash, memory-efficient,
# cuDNN) and the flash-attn package's ops (matched by name, as they register under their own namespace).
ATTENTION_OPS = tuple(
    packet.default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if (packet := getattr(torch.ops.aten, name, None)) is not None
)


def is_attention_kernel(op: Any) -> bool:
    """Whether ``op`` (an operator torch dispatches) is an attention forward kernel that can be kept."""
    name = str(op)
    return op in ATTENTION_OPS or ("flash_attn" in name and "backward" not in name and "bwd" not in name)


def _keep_attention_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_attention_kernel(op) else CheckpointPolicy.PREFER_RECOMPUTE


@dataclass(frozen=True)
class CheckpointSettings:
    """What each decoder layer keeps. ``checkpointed``: how many layers (the first ones) are checkpointed;
    ``keep_attention``: how many of those (the first ones) keep their attention outputs; ``offload``: whether
    the checkpointed layers' inputs wait in CPU memory."""

    checkpointed: int
    keep_attention: int = 0
    offload: bool = False

    def __post_init__(self) -> None:
        if self.checkpointed < 0 or not 0 <= self.keep_attention <= self.checkpointed:
            raise ConfigError(
                f"checkpointing: need 0 <= keep_attention ({self.keep_attention}) <= checkpointed "
                f"layers ({self.checkpointed})"
            )

    def describe(self, layers: int, on_gpu: bool = True) -> str:
        """One line for the run's log or plan; ``on_gpu`` False: says that offloading saves nothing on CPU."""
        text = f"{self.checkpointed} of {layers} layers checkpointed"
        if self.checkpointed:
            text += f", attention kept in {self.keep_attention}"
            if self.offload and on_gpu:
                text += ", inputs offloaded to CPU memory"
            elif self.offload:
                text += (
                    ", inputs copied to a second CPU buffer and back (no GPU in this run: the offloading runs its "
                    "steps but saves no memory)"
                )
        return text


class _Offloaded:
    """A layer input whose storage was freed: ``tensor``, its values in ``host`` (pinned on CUDA), the event that
    ends that copy, and once a fetch started, the event that ends it."""

    def __init__(self, tensor: torch.Tensor, host: torch.Tensor, copied: torch.cuda.Event | None) -> None:
        self.tensor, self.host, self.copied = tensor, host, copied
        self.nbytes = tensor.untyped_storage().nbytes()
        self.fetched: torch.cuda.Event | None = None
        self.back = False


class InputOffloader:
    """Keeps checkpointed layers' inputs in CPU memory between their layer's forward and its backward.

    When the backward reaches a layer's output, its input comes back (:meth:`_fetch`) and the fetch of the previous
    layer's input starts on a side stream. Pinned buffers are reused across steps. Without CUDA the copies are
    plain host copies (the same bookkeeping, for tests).
    """

    def __init__(self) -> None:
        self._waiting: list[_Offloaded] = []  # offloaded, not yet fetched back, in forward order
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._free: dict[tuple[torch.Size, torch.dtype], list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self.offloaded = 0  # inputs offloaded so far
        self.prefetched = 0  # fetches that had started before the backward asked for them

    def offload(self, tensor: torch.Tensor, output: Any) -> None:
        """Free ``tensor``'s storage until the backward reaches ``output`` (a tensor computed from it, or a tuple
        whose first element is). Does nothing without a backward to wait for, or when the tensor shares its storage."""
        output = output[0] if isinstance(output, (tuple, list)) else output
        grad_fn = getattr(output, "grad_fn", None)
        storage = tensor.untyped_storage()
        if (
            grad_fn is None
            or not tensor.is_contiguous()
            or tensor.storage_offset() != 0
            or storage.nbytes() != tensor.numel() * tensor.element_size()
        ):
            return
        if tensor.device.type == "cuda":
            out_stream, _ = self._streams_of(tensor.device)
            free = self._free.get((tensor.shape, tensor.dtype))  # pinned buffers are reused across steps
            buffer = free.pop() if free else (torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True), None)
            host, last_use = buffer
            out_stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the layer's forward has read it
            with torch.cuda.stream(out_stream):
                if last_use is not None:  # the buffer's previous fetch has read it
                    out_stream.wait_event(last_use)
                host.copy_(tensor.detach(), non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(out_stream)
            tensor.record_stream(out_stream)  # the freed memory is not reused before the copy has read it
        else:
            host, copied = tensor.detach().clone(), None
        handle = _Offloaded(tensor, host, copied)
        storage.resize_(0)
        self._waiting.append(handle)
        self.offloaded += 1
        grad_fn.register_prehook(lambda grad_outputs: self._fetch(handle))

    def _fetch(self, handle: _Offloaded) -> None:
        if handle.back:
            return
        position = self._waiting.index(handle) if handle in self._waiting else None
        if position is not None:
            del self._waiting[position]
        if handle.fetched is None:
            self._start_fetch(handle)
        else:
            self.prefetched += 1
        if handle.tensor.device.type == "cuda":
            current = torch.cuda.current_stream(handle.tensor.device)
            current.wait_event(handle.fetched)
            handle.tensor.record_stream(current)  # a no-op when this stream allocated it (_start_fetch), as it does
            self._free.setdefault((handle.host.shape, handle.host.dtype), []).append((handle.host, handle.fetched))
        handle.back = True
        if position:  # the input the backward reaches next
            self._start_fetch(self._waiting[position - 1])

    def _start_fetch(self, handle: _Offloaded) -> None:
        """Allocate ``handle``'s storage again, on the compute stream that reads it (so that its block returns to
        that stream's pool), and start copying its values back on the side stream, after the compute stream's work
        so far; the compute stream waits for the fetch's event (:meth:`_fetch`)."""
        if handle.fetched is not None:
            return
        tensor = handle.tensor
        tensor.untyped_storage().resize_(handle.nbytes)
        if tensor.device.type != "cuda":
            tensor.data.copy_(handle.host)  # through .data: the values come back without a new version
            handle.fetched = True
            return
        in_stream = self._streams_of(tensor.device)[1]
        in_stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(in_stream):
            in_stream.wait_event(handle.copied)
            tensor.data.copy_(handle.host, non_blocking=True)
            fetched = torch.cuda.Event()
            fetched.record(in_stream)
        handle.fetched = fetched

    def _streams_of(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]


def checkpoint_layer(
    keep_attention: bool, offloader: InputOffloader | None, function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """A decoder layer's ``_gradient_checkpointing_func`` (bound to its settings with ``partial``): torch's
    non-reentrant checkpoint, keeping the attention kernels' outputs when ``keep_attention``, with the layer input in
    CPU memory when ``offloader`` is given."""
    options: dict[str, Any] = {"use_reentrant": False}
    if keep_attention:  # a checkpoint that saves the attention kernels' outputs
        options["context_fn"] = partial(create_selective_checkpoint_contexts, _keep_attention_policy)
    output = checkpoint(function, *args, **options, **kwargs)
    if offloader is not None and args and isinstance(args[0], torch.Tensor):
        offloader.offload(args[0], output)
    return output


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's checkpointable decoder layers (transformers' ``GradientCheckpointingLayer``), in forward order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def apply_checkpointing(model: nn.Module, settings: CheckpointSettings) -> InputOffloader | None:
    """Checkpoint the first ``settings.checkpointed`` decoder layers of ``model`` as ``settings`` says and leave
    the others unchecked, in place, after (and overriding) ``gradient_checkpointing_enable``; returns the offloader
    (its counters) when inputs are offloaded."""
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(
            f"{type(model).__name__} has no checkpointable decoder layers (transformers' GradientCheckpointingLayer): "
            "train.checkpoint_layers and train.offload_checkpoints need them"
        )
    if settings.checkpointed > len(layers):
        raise ConfigError(
            f"train.checkpoint_layers={settings.checkpointed}: the model has {len(layers)} decoder layers"
        )
    offloader = InputOffloader() if settings.offload and settings.checkpointed else None
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < settings.checkpointed
        if layer.gradient_checkpointing:
            last = index == settings.checkpointed - 1  # its input is the first the backward needs: kept
            layer._gradient_checkpointing_func = partial(
                checkpoint_layer, index < settings.keep_attention, None if last else offloader
            )
    return offloader
