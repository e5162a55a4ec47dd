"""What longpeft does differently on the older stack that unsloth and the GPU image need (transformers 5.17,
trl 1.15, datasets 4; ``requirements-compat.txt``, tested by ``make test-compat``). Each piece is guarded by
the version or the missing feature, and does nothing on the pinned stack.

- trl < 1.16 computes the SFT loss only through a Triton kernel: ``trl.kernels`` imports ``triton`` at import
  time, so where Triton is missing (CPU builds of torch) ``trl.trainer.utils._ChunkedLogProbFunction`` is None
  and every training step fails with ``'NoneType' object has no attribute 'apply'``. trl 1.16 added a torch
  fallback. :func:`ensure_trl_loss_kernel` installs :class:`TorchChunkedLogProb` (same interface, plain torch)
  in that one case. GPU machines have Triton and keep trl's kernel.
- transformers 5.17 resumes a multi-process run by loading the optimizer state with
  ``map_location=args.device``, which under DDP on CPU is the indexed ``cpu:N`` that ``torch.load`` cannot
  restore to ("don't know how to restore data location ... tagged with cpu:0"); 5.23 maps it to ``cpu``.
  :func:`plain_cpu_device` gives such a run's arguments the plain ``cpu`` device (the same device).
- The other way round, transformers >= 5.23 deprecates ``is_gradient_checkpointing``, which peft and TRL (not
  longpeft) still read when they wrap or train a model: :func:`without_checkpointing_notice` hides that
  FutureWarning around longpeft's own calls into them (load, merge, export, plan --build, train).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from packaging.version import Version
from torch.utils.checkpoint import checkpoint

CHECKPOINTING_NOTICE = "`is_gradient_checkpointing` is deprecated"


@contextmanager
def without_checkpointing_notice() -> Iterator[None]:
    """Run a block without transformers' FutureWarning about ``is_gradient_checkpointing``, which peft and TRL
    read (other warnings are untouched)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=CHECKPOINTING_NOTICE, category=FutureWarning)
        yield


# trl's TOKEN_CHUNK_SIZE: tokens projected through the LM head at a time.
TOKEN_CHUNK_SIZE = 4096


def ensure_trl_loss_kernel() -> bool:
    """Give trl < 1.16 a loss kernel where it has none (no Triton); returns whether it was needed."""
    import trl.trainer.utils as trl_utils

    if not hasattr(trl_utils, "_ChunkedLogProbFunction") or trl_utils._ChunkedLogProbFunction is not None:
        return False
    trl_utils._ChunkedLogProbFunction = TorchChunkedLogProb
    return True


def plain_cpu_device(args) -> bool:
    """On transformers < 5.23, make a multi-process CPU run's ``args.device`` the plain ``cpu`` instead of
    ``cpu:<rank>``, so that ``--resume`` can load the optimizer state; returns whether it changed anything."""
    import transformers

    if Version(transformers.__version__) >= Version("5.23") or args.world_size < 2:
        return False
    device = args.device
    if device.type != "cpu" or device.index is None:
        return False
    args.__dict__["_setup_devices"] = torch.device("cpu")  # TrainingArguments.device reads this cached property
    return True


def _token_chunk(hidden, weight, bias, targets, inv_temperature, softcap, logit_scale, outputs):
    z = hidden @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.float() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z * inv_temperature
    log_z = torch.logsumexp(z, dim=-1)
    log_p = z - log_z.unsqueeze(-1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1) if "entropy" in outputs else None
    with torch.no_grad():
        log_sum_sq = torch.logsumexp(2 * log_p, dim=-1) if "log_sum_sq_probs" in outputs else None
        mean_logits = z.mean(-1) if "mean_logits" in outputs else None
        is_top1 = z.argmax(-1) == targets if "is_top1" in outputs else None  # the first maximum, as trl's kernel
    return logprobs, entropy, log_sum_sq, mean_logits, is_top1


class TorchChunkedLogProb:
    """``trl.kernels.ChunkedLogProbFunction`` in plain torch: per-token log-probabilities of ``targets`` (and
    entropy, sum of squared probabilities, mean logit, top-1 flags) through the LM head, ``TOKEN_CHUNK_SIZE``
    tokens at a time with each chunk's logits recomputed in backward, so at most one chunk's
    ``[tokens, vocab]`` logits exist at once. Same arguments and outputs as trl's ``apply``."""

    @staticmethod
    def apply(
        hidden,
        weight,
        bias,
        targets,
        temperature,
        chunk_size,
        final_logit_softcapping=None,
        logit_scale=1.0,
        outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
    ):
        del chunk_size  # trl's vocabulary tile; here each token chunk takes the whole vocabulary
        pieces = [
            checkpoint(
                _token_chunk,
                hidden[start : start + TOKEN_CHUNK_SIZE],
                weight,
                bias,
                targets[start : start + TOKEN_CHUNK_SIZE],
                1 / temperature,
                final_logit_softcapping,
                logit_scale,
                tuple(outputs),
                use_reentrant=False,
            )
            for start in range(0, max(hidden.shape[0], 1), TOKEN_CHUNK_SIZE)  # one (empty) chunk when no label counts
        ]
        return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*pieces))
