"""RoPE math and the v5-correct way to change a built model's RoPE parameters."""

import math

import pytest
import torch

from longpeft import rope
from longpeft.adapters.rope_base import expand_rope_base, resolve_rope_parameters
from longpeft.tiny import tiny_model


def test_inv_freq_is_bit_identical_to_transformers():
    model = tiny_model("llama")
    assert torch.equal(rope.inv_freq(10000.0, 16), model.model.rotary_emb.inv_freq)


def test_inv_freq_matches_closed_form():
    expected = torch.tensor([500000.0 ** (-2 * j / 128) for j in range(64)], dtype=torch.float64)
    assert torch.allclose(rope.inv_freq(500000.0, 128).double(), expected, rtol=1e-6)


@pytest.mark.parametrize("bad", [1.0, 0.5, -3])
def test_inv_freq_rejects_bad_base(bad):
    with pytest.raises(ValueError, match="base"):
        rope.inv_freq(bad, 16)


def test_per_head_rotation_matches_explicit_rotation_matrices():
    """cos_sin with [H, D/2] frequencies + apply_rotary == per-head 2x2 rotation matrices (float64)."""
    torch.manual_seed(0)
    bases, head_dim, seq = [1e4, 5e4, 2e5], 8, 6
    x = torch.randn(1, len(bases), seq, head_dim, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 5, 9, 30]])
    cos, sin = rope.cos_sin(positions, rope.per_head_inv_freq(bases, head_dim), dtype=torch.float64)
    ours = rope.apply_rotary(x, cos, sin)

    half = head_dim // 2
    reference = torch.empty_like(x)
    for h, base in enumerate(bases):
        for t, m in enumerate(positions[0].tolist()):
            for j in range(half):
                angle = m * base ** (-2 * j / head_dim)
                rotation = torch.tensor(
                    [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]], dtype=torch.float64
                )
                pair = torch.stack([x[0, h, t, j], x[0, h, t, j + half]])
                reference[0, h, t, j], reference[0, h, t, j + half] = rotation @ pair
    assert torch.allclose(ours, reference, atol=1e-5)


def test_assigning_rope_theta_is_ignored_by_transformers_v5():
    """The trap longpeft exists to avoid: the config changes, the rotary frequencies do not."""
    model = tiny_model("llama")
    before = model.model.rotary_emb.inv_freq.clone()
    model.config.rope_theta = 1e6
    assert torch.equal(model.model.rotary_emb.inv_freq, before)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_expand_rope_base_changes_frequencies_and_config(arch):
    model = tiny_model(arch)
    ids = torch.arange(3, 40)[None]
    before = model(ids).logits
    new = expand_rope_base(model, {"rope_theta": 2e8}, max_position_embeddings=4096)
    assert torch.equal(new, rope.inv_freq(2e8, rope.head_dim_of(model.config)))
    assert torch.equal(model.model.rotary_emb.inv_freq, new)
    assert model.config.rope_parameters["rope_theta"] == 2e8
    assert model.config.max_position_embeddings == 4096
    assert not torch.allclose(model(ids).logits, before)
    expand_rope_base(model, {"rope_theta": 10000.0}, max_position_embeddings=256)
    assert torch.equal(model(ids).logits, before)


def test_rotary_rounding_of_another_device_is_accepted_and_an_unchanged_base_refused():
    """On a CUDA base the rebuilt rotary's inv_freq (computed on the CPU by transformers, then moved) differed in the
    last bit from one computed on the GPU, and set_rope_parameters refused a correct base (H100, 2026-11-24). Here a
    rotary whose frequencies are one float32 step off stands for that device; one that ignores the config's base
    must still be refused."""
    model = tiny_model("llama")
    stock = type(model.model.rotary_emb)

    class OtherDeviceRounding(stock):
        def __init__(self, config, **kwargs):
            super().__init__(config, **kwargs)
            self.inv_freq = torch.nextafter(self.inv_freq, torch.full_like(self.inv_freq, math.inf))

    class IgnoresTheBase(stock):
        def __init__(self, config, **kwargs):
            super().__init__(config, **kwargs)
            self.inv_freq = rope.inv_freq(10000.0, self.inv_freq.numel() * 2)

    model.model.rotary_emb = OtherDeviceRounding(model.config)
    new = rope.set_rope_parameters(model, {"rope_type": "default", "rope_theta": 2e8})
    assert not torch.equal(new, rope.inv_freq(2e8, new.numel() * 2))  # one step off, and accepted
    torch.testing.assert_close(new, rope.inv_freq(2e8, new.numel() * 2), rtol=1e-6, atol=0)
    model.model.rotary_emb = IgnoresTheBase(model.config)
    with pytest.raises(RuntimeError, match="did not change to the requested rope_theta"):
        rope.set_rope_parameters(model, {"rope_type": "default", "rope_theta": 2e8})


@pytest.mark.parametrize(
    "request_, expected_type",
    [
        ({"rope_type": "linear", "factor": 4.0}, "linear"),
        ({"rope_type": "dynamic", "factor": 4.0}, "dynamic"),
        ({"rope_type": "yarn", "factor": 4.0}, "yarn"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}, "llama3"),
    ],
)
def test_transformers_rope_types_selectable(request_, expected_type):
    model = tiny_model("llama")
    base_freq = model.model.rotary_emb.inv_freq.clone()
    expand_rope_base(model, request_, max_position_embeddings=1024)
    assert model.model.rotary_emb.rope_type == expected_type
    assert model.config.rope_parameters["rope_type"] == expected_type
    if expected_type == "linear":
        assert torch.allclose(model.model.rotary_emb.inv_freq, base_freq / 4.0)
    if expected_type in ("yarn", "llama3"):
        assert model.config.rope_parameters["original_max_position_embeddings"] == 256
        assert not torch.equal(model.model.rotary_emb.inv_freq, base_freq)
    model(torch.arange(3, 20)[None])


def test_resolve_keeps_type_and_rejects_unknown():
    model = tiny_model("llama")
    assert resolve_rope_parameters(model.config, {"rope_theta": 5e5}) == {"rope_type": "default", "rope_theta": 5e5}
    with pytest.raises(ValueError, match="rope_type"):
        expand_rope_base(model, {"rope_type": "longrope"})
    with pytest.raises(ValueError, match="needs"):
        expand_rope_base(model, {"rope_type": "linear"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "rope.rope_type=llama3",
                "rope.factor=8",
                "rope.low_freq_factor=1",
                "rope.high_freq_factor=4",
                "rope.attention_factor=2",
            ],
            r"rope.attention_factor is not read by rope_type llama3",
        ),
        (["rope.factor=2"], r"rope.factor is not read by rope_type default"),
        (
            ["rope.rope_type=dynamic", "rope.factor=4"],
            r"rope_type dynamic rescales only beyond max_position_embeddings",
        ),
    ],
)
def test_recipes_refuse_rope_settings_transformers_would_ignore(overrides, message):
    """transformers logs and ignores keys a rope type does not read, and dynamic NTK never rescales inside the
    positions a recipe trains: either would train plain RoPE without a word, so the recipe refuses them."""
    from longpeft.recipes.schema import load_recipe
    from longpeft.recipes.validate import build_spec
    from longpeft.tiny import tiny_config

    recipe = load_recipe("tiny-cpu", overrides)
    with pytest.raises(ValueError, match=message):
        build_spec(recipe, tiny_config("llama"), "tiny")
    yarn = load_recipe("tiny-cpu", ["rope.rope_type=yarn", "rope.factor=4", "rope.attention_factor=1.2"])
    assert build_spec(yarn, tiny_config("llama"), "tiny").rope_parameters["attention_factor"] == 1.2
