"""transformers' ``tie_weights`` on a tied base whose tied modules peft wrapped (``longpeft.adapter_weights``): what
lm-eval's HFLM and ``resize_token_embeddings`` call. Stock transformers raises on peft's wrappers (or silently ties
the head to the embedding's trained copy); through longpeft it changes nothing on the model peft built, restores a
tie that was broken, and after a merge ties as transformers does."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from longpeft.adapter_weights import tie_through_peft_wrappers
from longpeft.tiny import tiny_model

pytestmark = pytest.mark.usefixtures("single_thread")

IDS = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))
CONFIGS = {  # how an adapter may train a tied embedding
    "modules_to_save, tied": dict(modules_to_save=["model.embed_tokens"], ensure_weight_tying=True),
    "modules_to_save, head apart": dict(modules_to_save=["model.embed_tokens"]),
    "trainable tokens": dict(trainable_token_indices={"model.embed_tokens": [5, 6, 7]}),
    "LoRA on the head": dict(target_modules=["q_proj", "lm_head"]),
}


def trained_peft_model(name: str):
    """A PeftModel of the tied tiny base with every trained weight moved (so a wrong tie shows in the logits)."""
    options = {"target_modules": ["q_proj"], **CONFIGS[name]}
    model = get_peft_model(tiny_model("llama-tied", vocab_size=400), LoraConfig(r=2, **options)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(torch.randn_like(parameter) * 0.5)
    return model


def logits(model, adapter: bool = True) -> torch.Tensor:
    with torch.no_grad():
        if adapter:
            return model(IDS).logits
        with model.disable_adapter():
            return model(IDS).logits


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tie_weights_keeps_the_model_peft_built(name):
    model = trained_peft_model(name)
    expected, without = logits(model), logits(model, adapter=False)
    names = set(model.state_dict())
    tie_through_peft_wrappers(model).tie_weights()
    torch.testing.assert_close(logits(model), expected, atol=0, rtol=0)
    torch.testing.assert_close(logits(model, adapter=False), without, atol=0, rtol=0)
    assert set(model.state_dict()) == names  # no parameter of its own given to a wrapper


def test_stock_tie_weights_breaks_on_peft_wrappers():
    """What the fix is for: transformers' own tie_weights on the same models (the reason these are not ignored)."""
    with pytest.raises(KeyError, match="attribute 'weight' already exists"):
        trained_peft_model("modules_to_save, tied").tie_weights()
    apart = trained_peft_model("modules_to_save, head apart")
    expected = logits(apart)
    apart.tie_weights()  # ties the head to the embedding's trained copy: another model
    assert (logits(apart) - expected).abs().max() > 1e-2


def test_a_broken_tie_is_tied_again_version_by_version():
    model = tie_through_peft_wrappers(trained_peft_model("modules_to_save, tied"))
    expected = logits(model)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)  # new parameters
    inner = model.get_base_model()
    head, embedding = inner.lm_head, inner.model.embed_tokens
    assert head.modules_to_save["default"].weight is not embedding.modules_to_save["default"].weight
    model.tie_weights()
    assert head.modules_to_save["default"].weight is embedding.modules_to_save["default"].weight
    assert head.original_module.weight is embedding.original_module.weight
    torch.testing.assert_close(logits(model), expected, atol=0, rtol=0)

    merged = model.merge_and_unload()  # no wrapper left: transformers' own tying
    merged.tie_weights()
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    torch.testing.assert_close(logits(merged), expected, atol=1e-5, rtol=0)
