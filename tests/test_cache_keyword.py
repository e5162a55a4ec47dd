"""transformers 5.24 renamed the KV-cache keyword of model forwards from ``past_key_values`` to ``cache``.

longpeft's replacement attention forwards (HARPE, Activation Beacon) and STRING's cache check must find the
cache under either name: a forward that misses it leaves the cache empty, and the next step's mask no longer
matches its keys (on 5.24 every beacon forward failed so). Each attention module is called directly here, with
the keyword arguments its decoder layer gives it, so both names are tested on any transformers version.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.models.llama.modeling_llama import LlamaModel

from longpeft.adapters.beacon import BeaconCache, apply_beacon, beacons_disabled
from longpeft.adapters.harpe.patch import apply_head_bases
from longpeft.adapters.string import enable_string
from longpeft.family import attention_modules, cache_keyword, pop_cache
from longpeft.tiny import tiny_model

pytestmark = pytest.mark.compat  # also run on the older stack (transformers 5.17: past_key_values)

NAMES = ("cache", "past_key_values")
IDS = torch.randint(3, 500, (1, 12), generator=torch.Generator().manual_seed(0))


def test_pop_cache_takes_either_name_and_refuses_both():
    cache = object()
    for name in NAMES:
        kwargs = {name: cache, "scaling": 1.0}
        assert pop_cache(kwargs) is cache and kwargs == {"scaling": 1.0}
    assert pop_cache({"cache": None, "past_key_values": None}) is None and pop_cache({}) is None
    with pytest.raises(ValueError, match="not both"):
        pop_cache({"cache": cache, "past_key_values": object()})


def test_cache_keyword_is_the_installed_llama_forwards():
    assert cache_keyword() in inspect.signature(LlamaModel.forward).parameters


def layer_call(model) -> tuple[torch.nn.Module, dict]:
    """Layer 0's attention module and the keyword arguments its decoder layer passes it for ``IDS``, cache removed."""
    attention, captured = attention_modules(model)[0], {}
    handle = attention.register_forward_pre_hook(
        lambda module, args, kwargs: captured.update(kwargs), with_kwargs=True
    )
    with torch.no_grad():
        model(IDS, use_cache=False)
    handle.remove()
    pop_cache(captured)
    return attention, captured


def head_bases(model) -> None:
    apply_head_bases(model, [1e4, 4e4])  # the tiny model's 2 key/value heads


def beacons(model) -> None:
    apply_beacon(model, {"window": 8, "ratios": [2]})


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("method", [head_bases, beacons])
def test_replacement_attention_writes_the_cache_given_by_either_name(method, name):
    """Beacons are switched off (the stock decoder stack calls the beacon attention forward, without a window)."""
    model = tiny_model("llama", attn_implementation="eager")
    method(model)
    with beacons_disabled(model) if method is beacons else contextlib.nullcontext():
        attention, kwargs = layer_call(model)
    with torch.no_grad():
        expected, _ = attention(**kwargs)
        cache = DynamicCache(config=model.config)
        output, _ = attention(**kwargs, **{name: cache})
    assert cache.get_seq_length(0) == IDS.shape[1]
    torch.testing.assert_close(output, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_string_refuses_a_static_cache_given_by_either_name(name):
    model = tiny_model("llama", attn_implementation="eager")
    enable_string(model, shift=4, local_window=2)
    attention, kwargs = layer_call(model)
    with pytest.raises(ValueError, match="DynamicCache"):
        attention(**kwargs, **{name: StaticCache(config=model.config, max_cache_len=32)})


@pytest.mark.parametrize("name", NAMES)
def test_beacon_decoder_stack_continues_a_cache_given_by_either_name(name):
    """``model.model`` (the beacon scheduler) takes the memory under either name and returns it under the
    installed transformers' name."""
    model = tiny_model("llama", attn_implementation="eager")
    beacons(model)
    cache = BeaconCache()
    with torch.no_grad():
        full = model.model(IDS).last_hidden_state
        first = model.model(IDS[:, :7], **{name: cache})
        second = model.model(IDS[:, 7:], **{name: cache}).last_hidden_state
    assert getattr(first, cache_keyword()) is cache and cache.state.raw_seen == IDS.shape[1]
    torch.testing.assert_close(second, full[:, 7:], atol=1e-5, rtol=0)
