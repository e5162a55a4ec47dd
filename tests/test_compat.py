"""The older stack's shims (longpeft/compat.py) against direct computations; runs on both stacks."""

from __future__ import annotations

import pytest
import torch

from longpeft import compat
from longpeft.compat import TorchChunkedLogProb, ensure_trl_loss_kernel

pytestmark = pytest.mark.compat


def reference(hidden, weight, bias, targets, temperature, softcap, scale):
    z = (hidden @ weight.t() + bias).float() * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temperature, dim=-1)
    return log_p.gather(-1, targets[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(-1), log_p


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_torch_chunked_log_probs_equal_full_logits_with_gradients(monkeypatch, softcap):
    monkeypatch.setattr(compat, "TOKEN_CHUNK_SIZE", 7)  # several chunks, the last one partial
    torch.manual_seed(0)
    hidden = torch.randn(20, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (20,))
    logprobs, entropy, log_sum_sq, mean_logits, is_top1 = TorchChunkedLogProb.apply(
        hidden, weight, bias, targets, 0.7, 32768, softcap, 1.3
    )
    want_logprobs, want_entropy, log_p = reference(hidden, weight, bias, targets, 0.7, softcap, 1.3)
    torch.testing.assert_close(logprobs, want_logprobs.float())
    torch.testing.assert_close(entropy, want_entropy.float())
    torch.testing.assert_close(log_sum_sq, torch.logsumexp(2 * log_p, -1).float())
    assert torch.equal(is_top1, log_p.argmax(-1) == targets) and mean_logits.shape == (20,)
    weights = torch.randn(20, dtype=torch.float64)
    grads = torch.autograd.grad((logprobs.double() * weights).sum() + entropy.sum(), (hidden, weight, bias))
    want = torch.autograd.grad((want_logprobs * weights).sum() + want_entropy.sum(), (hidden, weight, bias))
    for got, expected in zip(grads, want):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_no_labels_give_empty_outputs():
    out = TorchChunkedLogProb.apply(
        torch.zeros(0, 4),
        torch.randn(9, 4),
        None,
        torch.zeros(0, dtype=torch.long),
        1.0,
        32768,
        None,
        1.0,
        ("entropy",),
    )
    assert out[0].shape == (0,) and out[1].shape == (0,) and out[2] is None and out[4] is None


def test_the_shim_is_installed_only_where_trl_has_no_kernel(monkeypatch):
    import trl.trainer.utils as trl_utils

    kernel = trl_utils._ChunkedLogProbFunction
    if kernel is not None:  # trl 1.16 (torch fallback) or Triton present: trl's own kernel stays
        assert not ensure_trl_loss_kernel() and trl_utils._ChunkedLogProbFunction is kernel
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", None)  # trl 1.15 without Triton
    assert ensure_trl_loss_kernel() and trl_utils._ChunkedLogProbFunction is TorchChunkedLogProb
