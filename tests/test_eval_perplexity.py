"""Sliding-window perplexity against direct computations with full logits."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from longpeft.eval import evaluate, sliding_window_perplexity
from longpeft.eval import perplexity as perplexity_module
from longpeft.tiny import sample_text, tiny_model, train_tokenizer


@pytest.fixture(scope="module")
def setup():
    tokenizer = train_tokenizer()
    model = tiny_model("qwen3", vocab_size=len(tokenizer), attn_implementation="sdpa")
    ids = tokenizer(" ".join(sample_text(30, seed=5)))["input_ids"][:150]
    return model, tokenizer, ids


def reference_nll(model, ids, window, stride):
    """Per token: token t (t >= 1) is scored in the first window [k*stride, k*stride+window) that
    contains it as a not-yet-scored token, from that window's full logits."""
    n = len(ids)
    total, count, scored = 0.0, 0, 1  # token 0 is never predicted
    k = 0
    while scored < n:
        begin, end = k * stride, min(k * stride + window, n)
        with torch.no_grad():
            logp = model(torch.tensor([ids[begin:end]])).logits[0].double().log_softmax(-1)
        for t in range(max(scored, begin + 1), end):
            total -= float(logp[t - begin - 1, ids[t]])
            count += 1
        scored = max(scored, end)
        k += 1
    return total / count, count


def test_one_window_equals_the_model_loss(setup):
    model, tokenizer, ids = setup
    result = sliding_window_perplexity(model, tokenizer, input_ids=ids, window=256)
    with torch.no_grad():
        loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert result["n_scored"] == len(ids) - 1
    assert result["perplexity"] == pytest.approx(math.exp(float(loss)), rel=1e-5)


@pytest.mark.parametrize(("window", "stride"), [(64, 16), (64, 64), (50, 23)])
def test_sliding_windows_equal_direct_computation(setup, window, stride, monkeypatch):
    model, tokenizer, ids = setup
    monkeypatch.setattr(perplexity_module, "LOGIT_CHUNK", 7)  # exercise the chunked lm_head
    result = sliding_window_perplexity(model, tokenizer, input_ids=ids, window=window, stride=stride)
    nll, count = reference_nll(model, ids, window, stride)
    assert result["n_scored"] == count
    # overlapping windows score every token but the first; disjoint ones cannot score each window's first token
    assert count == len(ids) - 1 if stride < window else count == len(ids) - math.ceil(len(ids) / window)
    assert result["nll_per_token"] == pytest.approx(nll, rel=1e-5)


def test_text_file_through_evaluate(setup, tmp_path):
    model, tokenizer, ids = setup
    path = tmp_path / "text.txt"
    path.write_text(tokenizer.decode(ids))
    result = evaluate("perplexity", model, tokenizer, text=path, window=64, stride=32, out_dir=tmp_path)
    assert result["text"] == str(path) and result["perplexity"] > 1
    assert (tmp_path / "perplexity.json").exists()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        evaluate("perplexity", model, tokenizer, text=tmp_path / "missing.txt")
    with warnings.catch_warnings():  # a window longer than the text: the forwards see the text's tokens only
        warnings.simplefilter("error")
        short = evaluate("perplexity", model, tokenizer, text=path, window=100_000)
    assert short["window"] == short["n_tokens"] < model.config.max_position_embeddings
    with pytest.raises(ValueError, match="stride"):
        sliding_window_perplexity(model, tokenizer, input_ids=ids, window=8, stride=9)
