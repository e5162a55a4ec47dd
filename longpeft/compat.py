"""What longpeft does differently on the older stack of ``requirements-compat.txt`` (docs/scale.md), each piece
guarded by version or by the missing feature, and on the newest (:func:`without_checkpointing_notice`).
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
    """Run a block without transformers' (>= 5.23) ``is_gradient_checkpointing`` FutureWarning (peft, TRL)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=CHECKPOINTING_NOTICE, category=FutureWarning)
        yield


# trl's TOKEN_CHUNK_SIZE: tokens projected through the LM head at a time.
TOKEN_CHUNK_SIZE = 4096


def ensure_trl_loss_kernel() -> bool:
    """Give trl < 1.16 without Triton (no loss kernel) :class:`TorchChunkedLogProb`; returns whether it did."""
    import trl.trainer.utils as trl_utils

    if not hasattr(trl_utils, "_ChunkedLogProbFunction") or trl_utils._ChunkedLogProbFunction is not None:
        return False
    trl_utils._ChunkedLogProbFunction = TorchChunkedLogProb
    return True


def plain_cpu_device(args) -> bool:
    """On transformers < 5.23, make a multi-process CPU run's ``args.device`` the plain ``cpu`` instead of
    ``cpu:<rank>`` (which ``torch.load`` cannot restore the optimizer state to); returns whether it changed it."""
    import transformers

    old = Version(transformers.__version__) < Version("5.23")
    if not old or args.world_size < 2 or args.device.type != "cpu" or args.device.index is None:
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
    """``trl.kernels.ChunkedLogProbFunction`` in plain torch (same arguments and outputs as its ``apply``):
    per-token log-probabilities of ``targets`` and the requested ``outputs`` through the LM head,
    :data:`TOKEN_CHUNK_SIZE` tokens at a time, each chunk's ``[tokens, vocab]`` logits recomputed in backward."""

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
        options = (1 / temperature, final_logit_softcapping, logit_scale, tuple(outputs))
        pieces = []
        for start in range(0, max(hidden.shape[0], 1), TOKEN_CHUNK_SIZE):  # one (empty) chunk when no label counts
            rows = slice(start, start + TOKEN_CHUNK_SIZE)
            pieces.append(
                checkpoint(_token_chunk, hidden[rows], weight, bias, targets[rows], *options, use_reentrant=False)
            )
        return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*pieces))
