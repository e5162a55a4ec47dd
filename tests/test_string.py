"""STRING against an independent dense reference (paper Eq. 4), decode vs prefill, on/off."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers.modeling_utils import AttentionInterface

from longpeft.adapters.string import (
    disable_string,
    enable_string,
    string_attention_flash,
    string_attention_sdpa,
    string_settings,
)
from longpeft.rope import inv_freq as rope_inv_freq
from longpeft.tiny import tiny_model

SEQ = 72
SHIFT, WINDOW = 30, 6


def string_position_matrix(n_queries: int, n_keys: int, shift: int, window: int) -> torch.Tensor:
    """Paper Eq. 4 as an explicit relative-position matrix: P[i][j] = i - j, minus S - W where i - j >= S."""
    i = torch.arange(n_keys - n_queries, n_keys)[:, None]
    j = torch.arange(n_keys)[None, :]
    rel = i - j
    return torch.where(rel >= shift, rel - shift + window, rel)


def rotate64(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``x [..., D]`` by ``positions [...]`` with RoPE (float64, half-split convention)."""
    half = x.shape[-1] // 2
    freqs = 1.0 / base ** (torch.arange(0, half, dtype=torch.float64) * 2 / x.shape[-1])
    angles = positions.to(torch.float64)[..., None] * freqs
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def make_reference_attention(shift: int, window: int, base: float):
    """Attention function scoring every (i, j) with RoPE at distance P[i][j], by hand in float64."""

    def reference(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        n_queries, n_keys = query.shape[2], key.shape[2]
        groups = query.shape[1] // key.shape[1]
        q = query.double()
        k = key.double().repeat_interleave(groups, dim=1)
        v = value.double().repeat_interleave(groups, dim=1)
        # Undo RoPE: recover the raw vectors from the rotations at their own positions.
        q_raw = rotate64(q, -torch.arange(n_keys - n_queries, n_keys), base)
        k_raw = rotate64(k, -torch.arange(n_keys), base)
        rel = string_position_matrix(n_queries, n_keys, shift, window)  # [T, L]
        # score(i, j) = <R(P[i][j]) q_i, k_j>
        q_at = rotate64(q_raw[:, :, :, None, :], rel, base)  # [B, H, T, L, D]
        scores = (q_at * k_raw[:, :, None, :, :]).sum(-1) * scaling
        allowed = torch.ones(n_queries, n_keys, dtype=torch.bool).tril(n_keys - n_queries)
        if attention_mask is not None:
            allowed = allowed & (attention_mask == 0 if attention_mask.dtype != torch.bool else attention_mask)
        scores = scores.masked_fill(~allowed, -math.inf)
        out = scores.softmax(-1) @ v
        return out.transpose(1, 2).contiguous().to(query.dtype), None

    return reference


class ReferenceConfig:
    """Per-module config stand-in that routes one attention module to the reference function."""

    def __init__(self, base_config, name):
        object.__setattr__(self, "_base", base_config)
        object.__setattr__(self, "_attn_implementation", name)

    def __getattr__(self, name):
        return getattr(self._base, name)


def attention_outputs(model, input_ids):
    captured = []
    hooks = [
        m.register_forward_hook(lambda mod, args, out: captured.append(out[0].detach()))
        for m in model.modules()
        if type(m).__name__.endswith("Attention")
    ]
    with torch.no_grad():
        logits = model(input_ids).logits
    for h in hooks:
        h.remove()
    return captured, logits


def reference_run(model, input_ids, shift, window):
    name = f"longpeft_test_string_reference_{shift}_{window}"
    AttentionInterface.register(name, make_reference_attention(shift, window, 10000.0))
    modules = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    originals = [m.config for m in modules]
    for m in modules:
        m.config = ReferenceConfig(m.config, name)
    try:
        return attention_outputs(model, input_ids)
    finally:
        for m, c in zip(modules, originals):
            m.config = c


def ids(n=SEQ, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(7, 512, (batch, n), generator=g)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_matches_dense_reference(arch, impl):
    model = tiny_model(arch, attn_implementation=impl)
    x = ids()
    ref_attn, ref_logits = reference_run(model, x, SHIFT, WINDOW)
    enable_string(model, shift=SHIFT, local_window=WINDOW)
    attn, logits = attention_outputs(model, x)
    for a, r in zip(attn, ref_attn, strict=True):
        torch.testing.assert_close(a, r, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(logits, ref_logits, atol=5e-5, rtol=1e-4)
    # and STRING really changed something
    disable_string(model)
    _, plain = attention_outputs(model, x)
    assert (plain - logits).abs().max() > 1e-3


def test_small_blocks_and_batches_match_reference():
    """Block boundaries falling anywhere give the same result (block size 5 and 1)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 8, 40, 16), torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    freqs = rope_inv_freq(10000.0, 16)
    full = string_attention_sdpa(q, k, v, None, 11, 3, freqs, 0.25, block=64)
    for block in (1, 5):
        torch.testing.assert_close(string_attention_sdpa(q, k, v, None, 11, 3, freqs, 0.25, block=block), full)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_shift_at_least_length_equals_unpatched(impl):
    model = tiny_model("qwen2", attn_implementation=impl)
    x = ids()
    with torch.no_grad():
        plain = model(x).logits
        enable_string(model, shift=SEQ, local_window=WINDOW)
        patched = model(x).logits
    assert torch.equal(plain, patched)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_enable_then_disable_restores_exact_logits(impl):
    model = tiny_model("llama", attn_implementation=impl)
    x = ids()
    with torch.no_grad():
        plain = model(x).logits
        enable_string(model, shift=SHIFT, local_window=WINDOW)
        assert not torch.allclose(model(x).logits, plain)
        disable_string(model)
        assert string_settings(model) is None
        assert torch.equal(model(x).logits, plain)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_token_by_token_decode_equals_prefill(impl):
    model = tiny_model("qwen2", attn_implementation=impl)
    enable_string(model, shift=SHIFT, local_window=WINDOW)
    x = ids()
    with torch.no_grad():
        full = model(x).logits
        prefix = 20
        out = model(x[:, :prefix], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(prefix, SEQ):
            out = model(x[:, t : t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
        decoded = torch.cat(steps, dim=1)
        # a multi-token chunk after a cache (chunked prefill) too
        out = model(x[:, :50], use_cache=True)
        chunked = torch.cat([out.logits, model(x[:, 50:], past_key_values=out.past_key_values).logits], dim=1)
    torch.testing.assert_close(decoded, full, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(chunked, full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_left_padded_batch_matches_single_sequences(impl):
    model = tiny_model("llama", attn_implementation=impl)
    enable_string(model, shift=SHIFT, local_window=WINDOW)
    long, short = ids(SEQ, seed=1)[0], ids(SEQ - 17, seed=2)[0]
    batch = torch.zeros(2, SEQ, dtype=torch.long)
    mask = torch.zeros(2, SEQ, dtype=torch.long)
    batch[0], mask[0] = long, 1
    batch[1, 17:], mask[1, 17:] = short, 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(batch, attention_mask=mask, position_ids=position_ids).logits
        alone_long = model(long[None]).logits[0]
        alone_short = model(short[None]).logits[0]
    torch.testing.assert_close(padded[0], alone_long, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(padded[1, 17:], alone_short, atol=2e-5, rtol=1e-4)


def test_generate_runs_and_stops_on_eos():
    model = tiny_model("qwen3", attn_implementation="sdpa")
    enable_string(model, shift=SHIFT, local_window=WINDOW)
    x = ids(60)
    with torch.no_grad():
        gen = model.generate(x, max_new_tokens=8, do_sample=False)
        # greedy by hand with full forwards (no cache) gives the same tokens
        seq = x
        for _ in range(gen.shape[1] - x.shape[1]):
            nxt = model(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(gen, seq)


def reference_flash(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), return_attn_probs=False
):
    """flash_attn_func semantics in plain torch: [B, T, H, D] layout, bottom-right causal, window, LSE."""
    n_q, n_k = q.shape[1], k.shape[1]
    groups = q.shape[2] // k.shape[2]
    kk = k.repeat_interleave(groups, dim=2).double()
    vv = v.repeat_interleave(groups, dim=2).double()
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * softmax_scale
    dist = torch.arange(n_k - n_q, n_k)[:, None] - torch.arange(n_k)[None, :]
    allowed = torch.ones_like(dist, dtype=torch.bool)
    if causal:
        allowed &= dist >= 0
    if window_size[0] >= 0:
        allowed &= dist <= window_size[0]
    scores = scores.masked_fill(~allowed, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), vv)
    return out.to(q.dtype), lse.float(), None


@pytest.mark.parametrize("n_queries", [48, 1, 9])
def test_flash_merge_matches_sdpa_path(n_queries):
    """The flash-attn path's two calls + log-sum-exp merge, run with a reference kernel on CPU."""
    torch.manual_seed(1)
    n_keys = 48
    q = torch.randn(1, 8, n_queries, 16)
    k, v = torch.randn(1, 2, n_keys, 16), torch.randn(1, 2, n_keys, 16)
    freqs = rope_inv_freq(10000.0, 16)
    expected = string_attention_sdpa(q, k, v, None, 17, 4, freqs, 0.25)
    got = string_attention_flash(q, k, v, 17, 4, freqs, 0.25, flash_fn=reference_flash)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_attn_kernel_on_gpu():
    pytest.importorskip("flash_attn")
    torch.manual_seed(2)
    q = torch.randn(1, 8, 300, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 300, 64, device="cuda", dtype=torch.bfloat16)
    freqs = rope_inv_freq(10000.0, 64, "cuda")
    expected = string_attention_sdpa(q.float(), k.float(), v.float(), None, 100, 16, freqs, 0.125)
    got = string_attention_flash(q, k, v, 100, 16, freqs, 0.125)
    torch.testing.assert_close(got.float(), expected, atol=3e-2, rtol=3e-2)


def test_peft_wrapped_model_and_settings_roundtrip():
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama", attn_implementation="sdpa")
    x = ids()
    with torch.no_grad():
        enable_string(model, shift=SHIFT, local_window=WINDOW)
        expected = model(x).logits
        disable_string(model)
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).eval()
    settings = enable_string(peft_model, shift=SHIFT, local_window=WINDOW)
    assert (
        settings
        == string_settings(peft_model)
        == {"shift": SHIFT, "local_window": WINDOW, "trained_length": 256, "cos_sin_scale": None}
    )
    disable_string(peft_model)
    enable_string(peft_model, **settings)
    with torch.no_grad():
        torch.testing.assert_close(peft_model(x).logits, expected)  # fresh LoRA B = 0


def test_defaults_and_cos_sin_scale():
    model = tiny_model("llama", attn_implementation="sdpa", max_position_embeddings=1536)
    assert enable_string(model) == {"shift": 512, "local_window": 128, "trained_length": 1536, "cos_sin_scale": None}
    # the scale multiplies every logit by scale^2: same as scaling the attention temperature
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    freqs = rope_inv_freq(10000.0, 16)
    scaled = string_attention_sdpa(q, k, v, None, 11, 3, freqs, 0.25 * 1.07**2)
    modules = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    enable_string(model, shift=11, local_window=3, cos_sin_scale=1.07)
    from longpeft.adapters.string import string_attention_forward

    got, _ = string_attention_forward(modules[0], q, k, v, None, scaling=0.25)
    torch.testing.assert_close(got, scaled)


def test_clear_errors():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="local_window"):
        enable_string(model)  # S = 256 // 3 = 85 < W = 128
    with pytest.raises(ValueError, match="shift"):
        enable_string(model, shift=0, local_window=0)
    with pytest.raises(ValueError, match="cos_sin_scale"):
        enable_string(model, shift=40, local_window=8, cos_sin_scale=0.0)
    model.config.head_rope_bases = [1e4, 2e4]
    with pytest.raises(ValueError, match="HARPE"):
        enable_string(model, shift=40, local_window=8)
    assert string_settings(model) is None
    del model.config.head_rope_bases
    enable_string(model, shift=40, local_window=8)
    model.config.head_rope_bases = [1e4, 2e4]  # bases set after STRING: refused at the next forward
    with pytest.raises(ValueError, match="HARPE"):
        model(ids())
    del model.config.head_rope_bases
    from transformers import StaticCache

    with pytest.raises(ValueError, match="DynamicCache"):
        model(ids(), past_key_values=StaticCache(config=model.config, max_cache_len=128), use_cache=True)
    with pytest.raises(ValueError, match="model types"):
        enable_string(SimpleNamespace(config=SimpleNamespace(model_type="gpt2")))


def test_methods_string_cannot_run_with_are_refused_in_recipes_and_on_models():
    """STRING reads distances off cache indices with one RoPE base: HARPE and Activation Beacon break both, so a
    recipe naming both sections is refused before anything loads, and so is switching one on over the other."""
    from longpeft.adapters.beacon import BeaconConfig, apply_beacon, remove_beacon
    from longpeft.recipes.schema import RecipeError, load_recipe

    with pytest.raises(RecipeError, match="string and harpe cannot be combined: STRING needs one RoPE base"):
        load_recipe("tiny-harpe-cpu", ["string.shift=200", "string.local_window=8"])
    with pytest.raises(RecipeError, match="string and beacon cannot be combined: Activation Beacon"):
        load_recipe("tiny-beacon-cpu", ["string.shift=200", "string.local_window=8"])
    load_recipe("tiny-cpu", ["string.shift=200", "string.local_window=8"])  # with rope alone it is the intended use

    model = tiny_model("llama", attn_implementation="sdpa")
    settings = BeaconConfig(window=16, ratios=[4]).settings()
    apply_beacon(model, settings)
    with pytest.raises(
        ValueError,
        match="this model has beacon on, and string cannot be combined with it: Activation "
        "Beacon keeps positions .*; remove beacon from the model first",
    ):
        enable_string(model, shift=40, local_window=8)
    remove_beacon(model)
    enable_string(model, shift=40, local_window=8)
    with pytest.raises(
        ValueError,
        match="this model has string on, and beacon cannot be combined with it: .*reads distances off those",
    ):
        apply_beacon(model, settings)
    assert not hasattr(model.config, "beacon")  # refused before changing anything
    disable_string(model)
    apply_beacon(model, settings)
    remove_beacon(model)

    from longpeft.adapters.harpe import apply_head_bases, remove_head_bases

    apply_head_bases(model, [1e4, 1e5])
    with pytest.raises(
        ValueError, match="this model has harpe on, and string cannot be combined with it: STRING needs one RoPE base"
    ):
        enable_string(model, shift=40, local_window=8)
    remove_head_bases(model)
    model.config.head_rope_bases = [1e4, 1e5]  # how a merged HARPE model, built by its own modeling file, shows them
    with pytest.raises(ValueError, match="this model has harpe on"):
        enable_string(model, shift=40, local_window=8)
    del model.config.head_rope_bases
    enable_string(model, shift=40, local_window=8)
    with pytest.raises(ValueError, match="this model has string on, and harpe cannot be combined with it"):
        apply_head_bases(model, [1e4, 1e5])


def test_settings_recorded_in_a_context_spec_are_reapplied(tmp_path):
    from longpeft.adapters import apply_spec
    from longpeft.spec import ContextSpec

    source = tiny_model("qwen3", attn_implementation="sdpa")
    settings = enable_string(source, shift=SHIFT, local_window=WINDOW)
    spec = ContextSpec.from_base(source.config, "string", methods={"string": settings})
    spec.save(tmp_path)
    fresh = tiny_model("qwen3", attn_implementation="sdpa")
    apply_spec(fresh, ContextSpec.load(tmp_path))
    assert string_settings(fresh) == settings
    x = ids()
    with torch.no_grad():
        assert torch.equal(fresh(x).logits, source(x).logits)
