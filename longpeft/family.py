"""Model-family facts in one place: supported architectures, their attention modules, key/value heads, the label
their loss leaves out. Imports nothing heavy, so that exported modeling files can inline it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

# transformers model types whose attention longpeft's per-module patches (HARPE, STRING, beacon) know.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# The label the causal LMs' loss (torch's cross-entropy ``ignore_index``) leaves out: prompts, padding, markers.
IGNORE_INDEX = -100


def num_kv_heads(config: Any) -> int:
    """Number of key/value heads (``num_key_value_heads``, or the query heads for plain multi-head attention)."""
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def head_dim_of(config: Any) -> int:
    """Size of one attention head (``config.head_dim`` or ``hidden_size / num_attention_heads``)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# The modules peft's LoRA adapts, by class name (the others are containers, norms, activations, ...).
ADAPTABLE_KINDS = ("Linear", "Embedding", "Conv1D", "Conv1d", "Conv2d", "Conv3d", "MultiheadAttention")


def module_kinds(config: Any) -> dict[str, str] | None:
    """``{module name: kind}`` (``Linear``, ``Embedding`` or ``other``; ``named_modules()``'s names but the root's) of
    the causal LM a Llama-family config builds, from the config alone; None outside :data:`SUPPORTED_MODEL_TYPES`."""
    if getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return None
    kinds = {"model": "other", "model.embed_tokens": "Embedding", "model.layers": "other", "model.norm": "other"}
    kinds |= {"model.rotary_emb": "other", "lm_head": "Linear"}
    attention_norms = ("q_norm", "k_norm") if config.model_type == "qwen3" else ()
    for index in range(config.num_hidden_layers):
        layer = f"model.layers.{index}"
        kinds |= dict.fromkeys((layer, f"{layer}.self_attn", f"{layer}.mlp", f"{layer}.mlp.act_fn"), "other")
        kinds |= dict.fromkeys((f"{layer}.input_layernorm", f"{layer}.post_attention_layernorm"), "other")
        kinds |= {f"{layer}.self_attn.{name}": "Linear" for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        kinds |= {f"{layer}.self_attn.{name}": "other" for name in attention_norms}
        kinds |= {f"{layer}.mlp.{name}": "Linear" for name in ("gate_proj", "up_proj", "down_proj")}
    return kinds


def adaptable_kind(module: nn.Module) -> str:
    """A module's kind for :func:`module_kinds`: its (base) class name in :data:`ADAPTABLE_KINDS`, else ``other``."""
    for base in type(module).__mro__:
        if base.__name__ in ADAPTABLE_KINDS and base.__module__.startswith(("torch.", "transformers.")):
            return base.__name__
    return "other"


def is_attention_module(module: nn.Module) -> bool:
    """Whether ``module`` is a Llama-family self-attention (q/k/v/o projections, a layer index)."""
    return all(hasattr(module, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj", "layer_idx", "head_dim"))


def causal_lm_of(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside ``model`` (itself, or the base model of a peft wrapper)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def backbone_of(model: nn.Module) -> nn.Module:
    """The decoder stack (``model.model``) of a causal LM, plain or peft-wrapped."""
    causal_lm = causal_lm_of(model)
    backbone = getattr(causal_lm, causal_lm.base_model_prefix, None)
    if backbone is None or not hasattr(backbone, "layers") or not hasattr(backbone, "embed_tokens"):
        raise ValueError(f"{type(causal_lm).__name__} has no decoder stack with layers and embed_tokens")
    return backbone


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every self-attention module of a model (plain or PEFT-wrapped), in layer order."""
    return [m for m in model.modules() if is_attention_module(m)]


def check_supported(config: Any, what: str) -> None:
    """Raise a ConfigError naming ``what`` when the config's model type is not one longpeft patches."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{what} supports model types {', '.join(SUPPORTED_MODEL_TYPES)}; this model is {model_type!r}"
        )


def cache_keyword() -> str:
    """The name transformers gives the KV cache in model forwards, outputs and ``generate``'s model kwargs:
    ``"cache"`` from transformers 5.24, ``"past_key_values"`` before."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    return "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def pop_cache(kwargs: dict[str, Any]) -> Any:
    """Take the KV cache out of a forward's keyword arguments under either name of :func:`cache_keyword` and return
    it (None when neither is given; a ValueError when both are)."""
    cache, legacy = kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
    if cache is not None and legacy is not None:
        raise ValueError("give the KV cache once, as cache= (or past_key_values= before transformers 5.24), not both")
    return cache if cache is not None else legacy


def kernel_interface(module: nn.Module, implementation: str | None) -> Any:
    """The attention function transformers registers for ``implementation`` (``"sdpa"``, a flash-attn name, ...),
    or the model's own eager kernel (from ``module``'s modeling file) for eager or None."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager)


def attention_kernel(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """Run the attention kernel the model is configured for (eager, SDPA, flash-attn, ...) as the supported
    attention forwards do; returns ``(output [batch, seq, heads, head_dim], weights)``."""
    interface = kernel_interface(module, module.config._attn_implementation)
    return interface(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        # Qwen2/Qwen3 set it per layer, Mistral reads the config, Llama has none.
        sliding_window=getattr(module, "sliding_window", getattr(module.config, "sliding_window", None)),
        **kwargs,
    )


def define_export_classes(namespace: dict[str, Any], prefix: str, mixin: type) -> dict[str, tuple[str, str, str]]:
    """Declare, in a modeling file's ``namespace`` (its ``globals()``), per supported architecture
    ``{Prefix}LlamaConfig`` (model_type ``{prefix}_llama``, so that loading without trust_remote_code fails) and
    ``{Prefix}LlamaForCausalLM(mixin, LlamaForCausalLM)``, built together on first access (a module ``__getattr__``).

    Returns:
        base model_type -> (exported model_type, config class name, causal-LM class name), for ``auto_map``.
    """
    stems = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    title = prefix.capitalize()
    table = {
        model_type: (f"{prefix}_{model_type}", f"{title}{stem}Config", f"{title}{stem}ForCausalLM")
        for model_type, stem in stems.items()
    }
    model_type_of = {name: model_type for model_type, names in table.items() for name in names[1:]}

    def build(model_type: str) -> None:
        import transformers

        stem, (exported_type, config_name, model_name) = stems[model_type], table[model_type]
        attributes = {"__module__": namespace["__name__"]}
        config_class = type(
            config_name, (getattr(transformers, f"{stem}Config"),), {**attributes, "model_type": exported_type}
        )
        model_class = type(
            model_name,
            (mixin, getattr(transformers, f"{stem}ForCausalLM")),
            {**attributes, "config_class": config_class, "__doc__": f"{stem} with {mixin.__doc__}"},
        )
        namespace[config_name], namespace[model_name] = config_class, model_class

    def module_getattr(name: str) -> type:
        if name not in model_type_of:
            raise AttributeError(f"module {namespace['__name__']!r} has no attribute {name!r}")
        build(model_type_of[name])
        return namespace[name]

    namespace["__getattr__"] = module_getattr
    return table
