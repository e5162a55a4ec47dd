"""Activation checkpointing that keeps what memory allows and offloads what it must.

Under (non-reentrant) activation checkpointing a decoder layer keeps only its input hidden states
``[batch, seq, hidden]`` from its forward to its backward, and runs its forward again in the backward (the
recompute). Three levers trade that memory for time; each gives the same losses and gradients as
checkpointing every layer:

- ``checkpointed``: only the first N decoder layers are checkpointed; the others keep every activation and
  are not recomputed;
- ``keep_attention``: the first K checkpointed layers save the attention kernel's outputs in the forward
  (its output ``[batch, heads, seq, head_dim]``, its log-sum-exp ``[batch, heads, seq]`` in float32 and the
  kernel's bookkeeping), through torch's selective checkpointing policy, so their recompute skips the
  attention forward, the longest op of the recompute at long lengths;
- ``offload``: the checkpointed layers' inputs wait in pinned CPU memory. Each is copied out on a side
  stream while the forward goes on, and fetched back on another side stream one layer ahead of its recompute,
  so the copies overlap the compute; the last checkpointed layer's input, needed first, stays on the GPU.
  Only the layer inputs move (what torch's checkpoint saves for its recompute), not every activation as
  TRL's ``activation_offloading`` does.

:func:`apply_checkpointing` installs them on a transformers model's decoder layers (the
``GradientCheckpointingLayer`` modules, in forward order) once checkpointing is on (the Trainer turns it on
when training starts).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# Attention kernels whose outputs ``keep_attention`` saves: torch's SDPA backends (CPU, flash, memory-efficient,
# cuDNN) and the flash-attn package's ops (matched by name, as they register under their own namespace).
ATTENTION_OPS = tuple(
    packet.default
    for name in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if (packet := getattr(torch.ops.aten, name, None)) is not None
)


def is_attention_kernel(op: Any) -> bool:
    """Whether ``op`` (an operator torch dispatches) is an attention forward kernel that can be kept."""
    name = str(op)
    return op in ATTENTION_OPS or ("flash_attn" in name and "backward" not in name and "bwd" not in name)


def _keep_attention_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if is_attention_kernel(op) else CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention_contexts() -> tuple[Any, Any]:
    """The forward and recompute contexts of a checkpoint that saves the attention kernels' outputs."""
    return create_selective_checkpoint_contexts(_keep_attention_policy)


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
            raise ValueError(f"checkpointing: need 0 <= keep_attention ({self.keep_attention}) <= checkpointed "
                             f"layers ({self.checkpointed})")

    def describe(self, layers: int) -> str:
        """One line for the run's log, e.g. ``32 of 32 layers checkpointed, attention kept in 24, inputs
        offloaded to CPU memory``."""
        text = f"{self.checkpointed} of {layers} layers checkpointed"
        if self.checkpointed:
            text += f", attention kept in {self.keep_attention}"
            if self.offload:
                text += ", inputs offloaded to CPU memory"
        return text


class _Offloaded:
    """A layer input copied to host memory: ``host`` (pinned on CUDA), the event that ends the copy, and, once a
    fetch started, the device tensor and the event that ends the fetch."""

    def __init__(self, host: torch.Tensor, copied: torch.cuda.Event | None, device: torch.device) -> None:
        self.host, self.copied, self.device = host, copied, device
        self.fetched: tuple[torch.Tensor, torch.cuda.Event] | None = None


class InputOffloader:
    """Moves the tensors a checkpoint saves for its recompute (its inputs) to CPU memory and back.

    :meth:`offloading` is a context around one ``checkpoint`` call: the tensor it names is copied to host
    memory when the checkpoint saves it, and copied back when the backward asks for it. The backward asks in
    the reverse order of the forward, so each fetch also starts the fetch of the input saved just before, on a
    side stream: it is on the GPU when its layer's recompute starts. Pinned buffers are reused across steps.
    Without CUDA the copies are plain host copies (the same bookkeeping, for tests).
    """

    def __init__(self) -> None:
        self._pending: list[weakref.ref[_Offloaded]] = []  # copied out, not yet fetched, in forward order
        self._streams: dict[torch.device, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
        self._free: dict[tuple[torch.Size, torch.dtype], list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}
        self.offloaded = 0  # tensors copied out so far
        self.prefetched = 0  # fetches that had started before the backward asked

    @contextmanager
    def offloading(self, tensor: torch.Tensor) -> Iterator[None]:
        """Within the context, the autograd graph saves ``tensor`` in CPU memory; every other tensor as usual."""

        def pack(saved: torch.Tensor) -> Any:
            same = saved is tensor or (saved.data_ptr() == tensor.data_ptr() and saved.shape == tensor.shape
                                       and saved.stride() == tensor.stride() and saved.dtype == tensor.dtype)
            return self._copy_out(saved) if same else saved

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _copy_out(self, tensor: torch.Tensor) -> _Offloaded:
        self.offloaded += 1
        if tensor.device.type != "cuda":
            handle = _Offloaded(tensor.detach().clone(), None, tensor.device)
        else:
            out_stream, _ = self._streams_of(tensor.device)
            host, last_use = self._take_buffer(tensor)
            out_stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is computed
            with torch.cuda.stream(out_stream):
                if last_use is not None:  # the buffer's previous fetch has read it
                    out_stream.wait_event(last_use)
                host.copy_(tensor.detach(), non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(out_stream)
            tensor.record_stream(out_stream)  # its memory is not reused before the copy ends
            handle = _Offloaded(host, copied, tensor.device)
        self._pending.append(weakref.ref(handle))
        return handle

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Offloaded):
            return packed
        self._pending = [ref for ref in self._pending if ref() is not None]
        position = next((i for i, ref in enumerate(self._pending) if ref() is packed), None)
        if position is not None:
            del self._pending[position]
            if position > 0:  # the input the backward asks for next
                self._start_fetch(self._pending[position - 1]())
        if packed.device.type != "cuda":
            return packed.host
        if packed.fetched is None:
            self._start_fetch(packed)
        else:
            self.prefetched += 1
        tensor, fetched = packed.fetched
        current = torch.cuda.current_stream(packed.device)
        current.wait_event(fetched)
        tensor.record_stream(current)
        self._free.setdefault((packed.host.shape, packed.host.dtype), []).append((packed.host, fetched))
        packed.fetched = None
        return tensor

    def _start_fetch(self, handle: _Offloaded | None) -> None:
        if handle is None or handle.fetched is not None or handle.device.type != "cuda":
            return
        _, in_stream = self._streams_of(handle.device)
        with torch.cuda.stream(in_stream):
            in_stream.wait_event(handle.copied)
            tensor = torch.empty(handle.host.shape, dtype=handle.host.dtype, device=handle.device)
            tensor.copy_(handle.host, non_blocking=True)
            fetched = torch.cuda.Event()
            fetched.record(in_stream)
        handle.fetched = (tensor, fetched)

    def _streams_of(self, device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        if device not in self._streams:
            self._streams[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return self._streams[device]

    def _take_buffer(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        free = self._free.get((tensor.shape, tensor.dtype))
        if free:
            return free.pop()
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True), None


class LayerCheckpoint:
    """A decoder layer's ``_gradient_checkpointing_func``: torch's non-reentrant checkpoint, keeping the attention
    kernels' outputs when ``keep_attention``, with the layer input in CPU memory when ``offloader`` is given."""

    def __init__(self, keep_attention: bool, offloader: InputOffloader | None) -> None:
        self.keep_attention, self.offloader = keep_attention, offloader

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        options: dict[str, Any] = {"use_reentrant": False}
        if self.keep_attention:
            options["context_fn"] = keep_attention_contexts
        hidden = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if self.offloader is None or hidden is None:
            return checkpoint(function, *args, **options, **kwargs)
        with self.offloader.offloading(hidden):
            return checkpoint(function, *args, **options, **kwargs)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's checkpointable decoder layers (transformers' ``GradientCheckpointingLayer``), in forward order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def apply_checkpointing(model: nn.Module, settings: CheckpointSettings) -> InputOffloader | None:
    """Checkpoint the first ``settings.checkpointed`` decoder layers of ``model`` as ``settings`` says and leave
    the others unchecked, in place; returns the offloader (its counters) when inputs are offloaded.

    Call it after transformers turned checkpointing on (``gradient_checkpointing_enable``), which it overrides.
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no checkpointable decoder layers (transformers' "
                         "GradientCheckpointingLayer): train.checkpoint_layers and train.offload_checkpoints need them")
    if settings.checkpointed > len(layers):
        raise ValueError(f"train.checkpoint_layers={settings.checkpointed}: the model has {len(layers)} decoder layers")
    offloader = InputOffloader() if settings.offload and settings.checkpointed else None
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < settings.checkpointed
        if layer.gradient_checkpointing:
            last = index == settings.checkpointed - 1  # its input is the first the backward needs: kept
            layer._gradient_checkpointing_func = LayerCheckpoint(index < settings.keep_attention,
                                                                 None if last else offloader)
    return offloader

