"""Activation Beacon on a stock model: exactness where it must be exact (ratio 0, beacons off, removal),
decoding equals prefill, no state leaks between requests, batches (left padding refused), the caches and outputs it
refuses, gradient checkpointing, gradients through memory."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch
from transformers import DynamicCache

from longpeft.adapters.beacon import (
    BeaconCache,
    BeaconConfig,
    apply_beacon,
    beacon_parameters,
    beacons_disabled,
    is_beacon_applied,
    remove_beacon,
)
from longpeft.family import cache_keyword
from longpeft.tiny import tiny_model

# compat: also run by `make test-compat` (transformers 5.17, trl 1.15, datasets 4)
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]

IDS = torch.randint(3, 512, (2, 37), generator=torch.Generator().manual_seed(0))


def settings(**changes):
    """Small windows; one ratio for training and inference unless given."""
    ratios = changes.pop("ratios", [2])
    return BeaconConfig(
        window=8, ratios=ratios, inference_ratios=changes.pop("inference_ratios", ratios), **changes
    ).settings()


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("length", [32, 37])  # 4 full windows of 8; 4 windows and a partial one
def test_ratio_zero_and_beacons_off_equal_the_stock_model(implementation, length):
    model = tiny_model("llama", attn_implementation=implementation)
    ids = IDS[:, :length]
    with torch.no_grad():
        stock = model(ids, labels=ids)
        apply_beacon(model, settings(ratios=[0]))
        windowed = model(ids, labels=ids)
        apply_beacon(model, settings(ratios=[4]))
        compressed = model(ids, labels=ids)
        with beacons_disabled(model):
            off = model(ids, labels=ids)
    torch.testing.assert_close(windowed.logits, stock.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(windowed.loss, stock.loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(off.logits, stock.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(off.loss, stock.loss, atol=1e-5, rtol=0)
    # tokens before the first beacon (full-coverage interleave: raw tokens see earlier beacons) are
    # the same in every setting; later ones read beacons
    torch.testing.assert_close(compressed.logits[:, :4], stock.logits[:, :4], atol=1e-5, rtol=0)
    assert (compressed.logits[:, 9:] - stock.logits[:, 9:]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3", "llama-mha"])
def test_ratio_zero_on_every_architecture_and_with_left_padding(arch):
    model = tiny_model(arch, attn_implementation="sdpa")
    mask = torch.ones_like(IDS)
    mask[1, :5] = 0
    with torch.no_grad():
        stock = model(IDS, attention_mask=mask).logits
        apply_beacon(model, settings(ratios=[0]))
        windowed = model(IDS, attention_mask=mask).logits
    torch.testing.assert_close(windowed[0], stock[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(windowed[1, 5:], stock[1, 5:], atol=1e-5, rtol=0)


def test_ratio_zero_generates_like_the_stock_model_from_a_left_padded_batch():
    model = tiny_model("qwen2", attn_implementation="sdpa")
    mask = torch.ones_like(IDS[:, :21])
    mask[0, :6] = 0
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        stock = model.generate(IDS[:, :21], **kwargs)
        apply_beacon(model, settings(ratios=[0]))
        windowed = model.generate(IDS[:, :21], **kwargs)
    assert torch.equal(windowed.sequences, stock.sequences)
    torch.testing.assert_close(torch.stack(windowed.logits), torch.stack(stock.logits), atol=1e-4, rtol=0)


def test_remove_restores_the_stock_model_bit_for_bit():
    model = tiny_model("qwen3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        stock = model(IDS).logits
    apply_beacon(model, settings(params=["q", "k", "v", "o"], sink=1))
    assert is_beacon_applied(model) and model.config.beacon["sink"] == 1
    assert any(".beacon_" in k for k in model.state_dict())
    remove_beacon(model)
    assert not is_beacon_applied(model) and not hasattr(model.config, "beacon")
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert "forward" not in model.model.__dict__ and "_prepare_cache_for_generation" not in model.__dict__
    assert "forward" not in model.__dict__
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, stock)
    with pytest.raises(ValueError, match="no Activation Beacon"):
        remove_beacon(model)


def test_lora_projection_equals_the_full_copy_at_initialisation():
    full, lora = tiny_model("qwen2"), tiny_model("qwen2")
    apply_beacon(full, settings(params=["q", "k", "v", "o"]))
    apply_beacon(lora, settings(params=["q", "k", "v", "o"], projection="lora", lora_rank=4))
    with torch.no_grad():
        torch.testing.assert_close(lora(IDS).logits, full(IDS).logits, atol=1e-5, rtol=0)
        assert (full(IDS).logits - tiny_model("qwen2")(IDS).logits).abs().max() > 1e-4  # beacons do change the output
    sizes = {
        kind: sum(p.numel() for p in beacon_parameters(m).values()) for kind, m in (("full", full), ("lora", lora))
    }
    assert sizes["lora"] < sizes["full"] / 2


SCHEMES = [
    ("full-coverage", "interleave"),
    ("full-coverage", "append"),
    ("step-expansion", "append"),
    ("step-expansion", "interleave"),
    ("segmentation", "append"),
]


@pytest.mark.parametrize("attn,pos", SCHEMES)
def test_token_by_token_decoding_equals_one_prefill(attn, pos):
    model = tiny_model("llama", attn_implementation="eager")
    apply_beacon(model, settings(attn=attn, pos=pos, sink=1))
    ids = IDS[:1, :30]
    with torch.no_grad():
        prefill = model(ids).logits
        out = model(ids[:, :5])  # a partial first window, then one token at a time
        steps = [out.logits]
        cache = out.past_key_values
        assert isinstance(cache, BeaconCache)
        for t in range(5, 30):
            out = model(ids[:, t : t + 1], past_key_values=cache)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), prefill, atol=1e-5, rtol=0)
    assert cache.state.window_index == 3 and cache.state.memory_length == 1 + 3 * 4


def _generate(model, ids, **kwargs):
    return model.generate(
        ids,
        max_new_tokens=14,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )


def test_generate_decodes_like_a_prefill_and_requests_do_not_leak():
    model = tiny_model("mistral", attn_implementation="sdpa")
    apply_beacon(model, settings(ratios=[2, 4], inference_ratio_mix="adapt-16"))
    first, second = IDS[:1, :21], IDS[1:, :13]
    with torch.no_grad():
        alone = _generate(model, second)
        _generate(model, first)
        after = _generate(model, second)
        full = model(alone.sequences[:, :-1]).logits
    assert torch.equal(after.sequences, alone.sequences)
    torch.testing.assert_close(torch.stack(after.logits, 1), torch.stack(alone.logits, 1), atol=0, rtol=0)
    generated = torch.stack(alone.logits, dim=1)
    torch.testing.assert_close(generated, full[:, second.shape[1] - 1 :], atol=1e-5, rtol=0)


def test_a_batch_of_one_length_gives_each_prompt_what_it_gives_alone():
    """Independent reference: each prompt alone (unpadded, a batch of one), in a forward and in generate."""
    model = tiny_model("llama", attn_implementation="sdpa")
    apply_beacon(model, settings(sink=1))
    ids = IDS[:, :30]
    with torch.no_grad():
        batched, generated = model(ids).logits, _generate(model, ids)
        for row in range(2):
            alone, generated_alone = model(ids[row : row + 1]).logits, _generate(model, ids[row : row + 1])
            torch.testing.assert_close(batched[row], alone[0], atol=1e-5, rtol=0)
            assert torch.equal(generated.sequences[row], generated_alone.sequences[0])
            torch.testing.assert_close(
                torch.stack(generated.logits, 1)[row], torch.stack(generated_alone.logits, 1)[0], atol=1e-5, rtol=0
            )


def test_left_padding_is_refused_saying_why_and_what_to_do():
    """Windows start at the same index in every row: a left-padded row's windows would not be its prompt's (its
    logits were off by 0.39 here, the stock model's by 2e-7). Right padding (TRL's training batches) leaves a row's
    tokens where they are alone; ratio 0 (no beacons) takes either."""
    model = tiny_model("llama", attn_implementation="sdpa")
    apply_beacon(model, settings(sink=1))
    row = IDS[1:, :22]
    left = torch.cat([IDS[:1, :30], torch.cat([torch.zeros(1, 8, dtype=torch.long), row], dim=1)])
    mask = torch.ones_like(left)
    mask[1, :8] = 0
    refused = (
        r"row 1 of the batch has tokens after padding \(left padding\); beacon windows start at the same "
        r"index in every row.*batch prompts of one length, or give one prompt at a time"
    )
    with torch.no_grad(), pytest.raises(ValueError, match=refused):
        model(left, attention_mask=mask)
    with torch.no_grad(), pytest.raises(ValueError, match=refused):
        _generate(model, left, attention_mask=mask)
    with torch.no_grad(), pytest.raises(ValueError, match=refused):  # padding, then tokens in a later call
        cache = model(left[:, :8], attention_mask=mask[:, :8]).past_key_values
        model(left[:, 8:], past_key_values=cache)

    right = torch.cat([IDS[:1, :30], torch.cat([row, torch.zeros(1, 8, dtype=torch.long)], dim=1)])
    with torch.no_grad():
        batched, alone = model(right, attention_mask=mask.flip(1)).logits[1, :22], model(row).logits[0]
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)


def test_only_a_beacon_cache_carries_memory_across_calls_and_generate():
    """A DynamicCache (the stock way to continue) is refused rather than silently left empty; a BeaconCache passed
    in continues, in forwards and in generate."""
    model = tiny_model("llama", attn_implementation="sdpa")
    apply_beacon(model, settings())
    ids = IDS[:1, :24]
    with torch.no_grad():
        with pytest.raises(ValueError, match=rf"{cache_keyword()}=BeaconCache\(\) or None"):
            model(ids[:, :20], past_key_values=DynamicCache(config=model.config))
        with pytest.raises(ValueError, match="got a DynamicCache"):
            _generate(model, ids, past_key_values=DynamicCache(config=model.config))
        cache = BeaconCache()
        model(ids[:, :20], past_key_values=cache)
        continued = model(ids[:, 20:], past_key_values=cache).logits
        full = model(ids).logits[:, 20:]
        alone = _generate(model, ids)
        cache = BeaconCache()
        given = _generate(model, ids, past_key_values=cache)
        more = _generate(model, given.sequences, past_key_values=cache)
        scratch = _generate(model, given.sequences)
    torch.testing.assert_close(continued, full, atol=1e-5, rtol=0)
    assert given.past_key_values is cache and torch.equal(given.sequences, alone.sequences)
    assert torch.equal(more.sequences, scratch.sequences)
    torch.testing.assert_close(torch.stack(more.logits, 1), torch.stack(scratch.logits, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("keep", [1, 7])  # 7: the last partial window's 5 tokens and 2 of the window before
def test_logits_to_keep_keeps_only_the_hidden_states_it_scores(keep):
    """The decoder stack returns ``[batch, keep, hidden]``, not one row per token, and the logits are the full
    forward's last rows; generate reads the same signature as the stock forward's (``logits_to_keep``)."""
    model = tiny_model("llama", attn_implementation="sdpa")
    stock_signature = inspect.signature(model.forward)
    apply_beacon(model, settings())
    assert inspect.signature(model.forward) == stock_signature and model._supports_logits_to_keep()
    kept = []
    model.model.register_forward_hook(lambda module, args, out: kept.append(tuple(out.last_hidden_state.shape)))
    with torch.no_grad():
        full = model(IDS).logits
        last = model(IDS, logits_to_keep=keep).logits
        _generate(model, IDS)
    assert kept[0] == (2, 37, 64) and kept[1] == (2, keep, 64)
    assert kept[2] == (2, 1, 64)  # generate's prefill
    torch.testing.assert_close(last, full[:, -keep:], atol=1e-5, rtol=0)
    model.train()
    loss = model(IDS, logits_to_keep=keep).logits.sum()
    loss.backward()  # training through the kept rows
    assert kept[-1] == (2, keep, 64)


@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
def test_hidden_states_and_attentions_are_refused_rather_than_dropped(flag):
    model = tiny_model("llama", attn_implementation="eager")
    apply_beacon(model, settings())
    with torch.no_grad(), pytest.raises(ValueError, match=f"{flag}=True is not supported with Activation Beacon"):
        model(IDS, **{flag: True})
    with beacons_disabled(model), torch.no_grad():
        assert getattr(model(IDS, **{flag: True}), flag.removeprefix("output_")) is not None


def test_generate_in_training_mode_keeps_the_beacons_of_every_window():
    """A training forward over a whole input gives the window that ends it no beacons; generate continues its
    cache, so every window keeps them, as in eval mode (before: the windows stayed raw, 36 memory entries, not 24)."""
    model = tiny_model("llama", attn_implementation="sdpa")
    apply_beacon(model, settings())
    with torch.no_grad():
        evaluated = _generate(model, IDS[:1, :30])
        model.train()
        trained = _generate(model, IDS[:1, :30])
    assert trained.past_key_values.state.memory_length == evaluated.past_key_values.state.memory_length == 5 * 4
    assert torch.equal(trained.sequences, evaluated.sequences)
    torch.testing.assert_close(torch.stack(trained.logits, 1), torch.stack(evaluated.logits, 1), atol=1e-5, rtol=0)


def test_generate_with_beacons_off_equals_the_stock_model():
    model = tiny_model("llama", attn_implementation="sdpa")
    with torch.no_grad():
        stock = _generate(model, IDS[:, :21])
        apply_beacon(model, settings(ratios=[4]))
        with beacons_disabled(model):
            off = _generate(model, IDS[:, :21])
    assert torch.equal(off.sequences, stock.sequences)
    torch.testing.assert_close(torch.stack(off.logits, 1), torch.stack(stock.logits, 1), atol=1e-5, rtol=0)


def test_a_refused_reapply_keeps_the_trained_beacons():
    model = tiny_model("llama", attn_implementation="sdpa")
    apply_beacon(model, settings(ratios=[4]))
    with torch.no_grad():
        model.model.beacon_embed_tokens.weight.fill_(0.5)  # stands for trained beacon weights
    before = {k: v.clone() for k, v in beacon_parameters(model).items()}
    model.config.eos_token_id = None
    with pytest.raises(ValueError, match="eos_token_id"):
        apply_beacon(model, settings(ratios=[2], embed_init="eos"))
    assert is_beacon_applied(model) and model.config.beacon["ratios"] == [4]
    after = beacon_parameters(model)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_generate_batches_rows_of_one_layout_and_refuses_beam_search():
    model = tiny_model("llama", attn_implementation="sdpa")
    apply_beacon(model, settings())
    with torch.no_grad():
        batch = _generate(model, IDS[:, :19]).sequences
        rows = [_generate(model, IDS[i : i + 1, :19]).sequences for i in range(2)]
        sampled = model.generate(IDS[:, :19], max_new_tokens=5, do_sample=True, top_k=5, pad_token_id=0)
    assert torch.equal(batch, torch.cat(rows))
    assert sampled.shape == (2, 24)
    with pytest.raises(ValueError, match="greedy and sampling"):
        model.generate(IDS[:1, :19], max_new_tokens=3, num_beams=2, pad_token_id=0)


def _loss_and_grads(model, ids, labels):
    model.zero_grad()
    loss = model(ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in beacon_parameters(model).items() if p.grad is not None}


def _trainable_beacons(model):
    for p in model.parameters():
        p.requires_grad_(False)
    for p in beacon_parameters(model).values():
        p.requires_grad_(True)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    model = tiny_model("qwen3", attn_implementation="sdpa")
    apply_beacon(model, settings(params=["q", "k", "v", "o"], sink=1))
    _trainable_beacons(model)
    model.train()
    plain = _loss_and_grads(model, IDS, IDS)
    model.gradient_checkpointing_enable()
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    checkpointed = _loss_and_grads(model, IDS, IDS)
    torch.testing.assert_close(checkpointed[0], plain[0], atol=1e-6, rtol=0)
    assert plain[1].keys() == checkpointed[1].keys() and len(plain[1]) == len(beacon_parameters(model))
    for name, grad in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], grad, atol=1e-6, rtol=1e-5)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with pytest.raises(ValueError, match="non-reentrant"):
        model(IDS, labels=IDS)


def test_a_loss_on_the_last_window_trains_the_beacons_of_earlier_windows():
    model = tiny_model("llama", attn_implementation="sdpa")
    apply_beacon(model, settings())
    _trainable_beacons(model)
    model.train()
    labels = IDS.clone()
    labels[:, :32] = -100  # only the last (partial) window is scored; it has no beacons of its own
    _, grads = _loss_and_grads(model, IDS, labels)
    last = len(model.model.layers) - 1
    # the last layer's beacon queries only shape the beacons' own outputs, which nothing reads
    expected = {n for n in beacon_parameters(model) if not n.startswith(f"layers.{last}.self_attn.beacon_q")}
    assert {n for n, g in grads.items() if g.abs().sum() > 0} == expected


@pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None,
    reason="flash-attn needs CUDA and the flash_attn package",
)
def test_flash_attention_full_coverage_matches_sdpa():
    ids = IDS.cuda()
    outputs = {}
    for implementation in ("sdpa", "flash_attention_2"):
        model = tiny_model("llama", attn_implementation=implementation).to("cuda", torch.bfloat16)
        apply_beacon(model, settings(ratios=[2]))
        with torch.no_grad():
            outputs[implementation] = model(ids).logits.float()
    torch.testing.assert_close(outputs["flash_attention_2"], outputs["sdpa"], atol=3e-2, rtol=0)


def test_beacons_over_a_4bit_base(tiny_base_dirs):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )

    def load():
        return AutoModelForCausalLM.from_pretrained(
            tiny_base_dirs("llama"), quantization_config=quantization, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()

    full, lora = load(), load()
    assert type(full.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    ids = IDS.to(full.device)  # bitsandbytes puts a 4-bit model on the GPU where there is one
    with torch.no_grad():
        stock = full(ids).logits
        apply_beacon(full, settings(ratios=[0]))
        torch.testing.assert_close(full(ids).logits, stock, atol=1e-5, rtol=0)
        apply_beacon(full, settings())  # full copies of the dequantised weights
        apply_beacon(lora, settings(projection="lora", lora_rank=4))
        # bitsandbytes' CPU kernel multiplies in bfloat16: the copy equals the 4-bit layer to that precision
        torch.testing.assert_close(lora(ids).logits, full(ids).logits, atol=5e-3, rtol=0)
    # training (bitsandbytes repacks a CPU weight for inference after an eval forward: train a fresh load)
    trained = load().train()
    apply_beacon(trained, settings(projection="lora", lora_rank=4))
    _trainable_beacons(trained)
    _, grads = _loss_and_grads(trained, ids, ids)
    assert len(grads) == len(beacon_parameters(trained))
    # B = 0: A gets no gradient yet; the last layer's beacon queries shape outputs nothing reads
    unused = [n for n in grads if "lora_A" in n or n.startswith("layers.1.self_attn.beacon_q")]
    assert all(g.abs().sum() > 0 for n, g in grads.items() if n not in unused)
