"""HARPE per-head RoPE: an independent dense reference, exactness, KV cache, GQA, errors."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from longpeft.adapters.harpe import apply_head_bases, has_head_bases, remove_head_bases, uniform_bases
from longpeft.family import head_dim_of
from longpeft.tiny import tiny_model

ARCHS = ["llama", "llama-mha", "mistral", "qwen2", "qwen3"]


def _ids(batch: int = 2, seq: int = 24, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _spread_bases(model) -> list[float]:
    """Very different bases per KV head, so a wrong head->base assignment shows up in the outputs."""
    return uniform_bases(3.0, 3e4, model.config.num_key_value_heads)


# ---- independent dense reference (float64, explicit 2x2 rotations and causal mask) ---------------


def _rotation_matrix(position: int, base: float, head_dim: int) -> torch.Tensor:
    """``[D, D]`` float64: a 2x2 rotation by ``position * base**(-2j/D)`` on each pair ``(j, j + D/2)``."""
    half = head_dim // 2
    rotation = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    for j in range(half):
        angle = position * base ** (-2 * j / head_dim)
        c, s = math.cos(angle), math.sin(angle)
        rotation[j, j], rotation[j, j + half] = c, -s
        rotation[j + half, j], rotation[j + half, j + half] = s, c
    return rotation


def _linear(x: torch.Tensor, layer) -> torch.Tensor:
    y = x @ layer.weight.double().T
    return y + layer.bias.double() if layer.bias is not None else y


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.double()


def _reference_attention(attn, hidden: torch.Tensor, bases: list[float]) -> torch.Tensor:
    """Self-attention of one layer with query head h rotated by the base of KV head h // group.

    Args:
        hidden: float64 ``[B, T, hidden]``. Returns float64 ``[B, T, hidden]``.
    """
    batch, seq, _ = hidden.shape
    d = attn.head_dim
    q = _linear(hidden, attn.q_proj).view(batch, seq, -1, d)
    k = _linear(hidden, attn.k_proj).view(batch, seq, -1, d)
    v = _linear(hidden, attn.v_proj).view(batch, seq, -1, d)
    if hasattr(attn, "q_norm"):
        q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
    n_q, n_kv = q.shape[2], k.shape[2]
    group = n_q // n_kv
    rotations = {(g, t): _rotation_matrix(t, bases[g], d) for g in range(n_kv) for t in range(seq)}
    out = torch.zeros(batch, seq, n_q, d, dtype=torch.float64)
    for b in range(batch):
        for h in range(n_q):
            g = h // group
            q_rot = torch.stack([rotations[g, t] @ q[b, t, h] for t in range(seq)])
            k_rot = torch.stack([rotations[g, t] @ k[b, t, g] for t in range(seq)])
            scores = q_rot @ k_rot.T / math.sqrt(d)
            causal = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
            scores = scores.masked_fill(~causal, float("-inf"))
            out[b, :, h] = torch.softmax(scores, dim=-1) @ v[b, :, g]
    return _linear(out.reshape(batch, seq, n_q * d), attn.o_proj)


def _reference_logits(model, ids: torch.Tensor, bases: list[float]) -> torch.Tensor:
    """A whole Llama-family forward in float64 with the reference attention."""
    inner = model.model
    x = inner.embed_tokens.weight.double()[ids]
    for layer in inner.layers:
        x = x + _reference_attention(layer.self_attn, _rms_norm(x, layer.input_layernorm), bases)
        h = _rms_norm(x, layer.post_attention_layernorm)
        mlp = layer.mlp
        x = x + _linear(torch.nn.functional.silu(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)
    return _linear(_rms_norm(x, inner.norm), model.lm_head)


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_dense_reference(arch):
    model = tiny_model(arch)
    bases = _spread_bases(model)
    apply_head_bases(model, bases)
    ids = _ids(seq=12)
    captured = {}

    def keep_io(module, args, kwargs, output):
        captured["hidden"], captured["out"] = kwargs["hidden_states"], output[0]

    handle = model.model.layers[0].self_attn.register_forward_hook(keep_io, with_kwargs=True)
    with torch.no_grad():
        logits = model(ids).logits
        handle.remove()
        attn_ref = _reference_attention(model.model.layers[0].self_attn, captured["hidden"].double(), bases)
        logits_ref = _reference_logits(model, ids, bases)
    torch.testing.assert_close(captured["out"].double(), attn_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(logits.double(), logits_ref, atol=1e-4, rtol=1e-4)
    # The reference really depends on the bases: the stock model (one base) is far from it.
    with torch.no_grad():
        stock = tiny_model(arch)(ids).logits.double()
    assert (stock - logits_ref).abs().max() > 1e-3  # ten times the tolerance above


def test_sdpa_matches_dense_reference():
    model = tiny_model("qwen2", attn_implementation="sdpa")
    bases = _spread_bases(model)
    apply_head_bases(model, bases)
    ids = _ids(seq=10)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits.double(), _reference_logits(model, ids, bases), atol=1e-4, rtol=1e-4
        )


# ---- exactness against the unpatched model --------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_equal_bases_give_the_unpatched_model_exactly(arch):
    ids = _ids()
    for attn_implementation in ("eager", "sdpa"):
        model = tiny_model(arch, attn_implementation=attn_implementation)
        with torch.no_grad():
            stock = model(ids).logits
            apply_head_bases(model, [1e4] * model.config.num_key_value_heads)
            patched = model(ids).logits
        if attn_implementation == "eager":
            assert torch.equal(stock, patched)
        else:
            torch.testing.assert_close(stock, patched, atol=1e-6, rtol=1e-6)


def test_remove_restores_the_model_and_config():
    model = tiny_model("llama")
    ids = _ids()
    with torch.no_grad():
        stock = model(ids).logits
        apply_head_bases(model, _spread_bases(model))
        assert has_head_bases(model) and model.config.head_rope_bases == _spread_bases(model)
        assert not torch.allclose(model(ids).logits, stock)
        remove_head_bases(model)
        assert torch.equal(model(ids).logits, stock)
    assert not has_head_bases(model) and not hasattr(model.config, "head_rope_bases")
    with pytest.raises(ValueError, match="no HARPE"):
        remove_head_bases(model)


def test_applying_again_replaces_the_bases():
    ids = _ids()
    model, fresh = tiny_model("llama"), tiny_model("llama")
    apply_head_bases(model, [5.0, 7.0])
    apply_head_bases(model, _spread_bases(model))
    apply_head_bases(fresh, _spread_bases(fresh))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)
    remove_head_bases(model)  # still restores the original rotary module
    with torch.no_grad():
        assert torch.equal(model(ids).logits, tiny_model("llama")(ids).logits)


# ---- KV cache --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,attn_implementation", [("llama", "eager"), ("qwen3", "sdpa"), ("qwen2", "eager")])
def test_prefill_then_decode_equals_full_forward(arch, attn_implementation):
    model = tiny_model(arch, attn_implementation=attn_implementation)
    apply_head_bases(model, _spread_bases(model))
    ids = _ids(batch=2, seq=20, seed=3)
    prefill = 12
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        steps = [model(ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
        for t in range(prefill, ids.shape[1]):
            steps.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_generate_with_cache_equals_without():
    model = tiny_model("mistral")
    apply_head_bases(model, _spread_bases(model))
    prompt = _ids(batch=1, seq=8, seed=5)
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        cached = model.generate(prompt, use_cache=True, **kwargs)
        uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.shape[1] == 18 and torch.equal(cached, uncached)


# ---- grouped-query attention and errors -----------------------------------------------------------


def test_gqa_keeps_one_base_per_kv_head():
    model = tiny_model("qwen2")  # 8 query heads read 2 KV heads
    assert model.config.num_attention_heads == 8 and model.config.num_key_value_heads == 2
    with pytest.raises(ValueError, match="2 key/value heads"):
        apply_head_bases(model, uniform_bases(1e4, 1e6, 8))  # one per query head is wrong
    apply_head_bases(model, [100.0, 1e6])
    rotary = model.model.rotary_emb
    cos, _ = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(5)[None])
    assert cos.shape == (1, 2, 5, head_dim_of(model.config))  # [B, kv_heads, T, D]
    assert model.config.head_rope_bases == [100.0, 1e6]
    # Swapping the two bases changes the output: each group really uses its own KV head's base.
    ids = _ids()
    with torch.no_grad():
        first = model(ids).logits
        apply_head_bases(model, [1e6, 100.0])
        assert not torch.allclose(first, model(ids).logits)


def test_bad_input_is_rejected_with_clear_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="finite and > 1"):
        apply_head_bases(model, [1e4, 0.5])
    with pytest.raises(ValueError, match="finite and > 1"):
        apply_head_bases(model, [1e4, float("nan")])
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(ValueError, match="supports model types"):
        apply_head_bases(gpt2, [1e4, 1e4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-attn needs a CUDA GPU")
def test_flash_attention_matches_sdpa_on_gpu():
    pytest.importorskip("flash_attn")
    ids = _ids().cuda()
    outputs = []
    for attn_implementation in ("sdpa", "flash_attention_2"):
        model = tiny_model("qwen2", attn_implementation=attn_implementation).to("cuda", torch.bfloat16)
        apply_head_bases(model, _spread_bases(model))
        with torch.no_grad():
            outputs.append(model(ids).logits.float())
    torch.testing.assert_close(outputs[0], outputs[1], atol=5e-2, rtol=5e-2)
