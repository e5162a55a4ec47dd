"""The model of a recipe, for every backend: the base (a Hub model, a local folder or a generated ``tiny:`` one),
its ContextSpec and the methods applied to it, 4-bit quantization, and the peft glue (the LoRA config, trained
embeddings, trained weights' dtype).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..adapter_weights import tied_copies, tied_copies_bytes, write_tied_copies
from ..adapters import METHODS, apply_spec, export_methods, save_method_weights
from ..base_config import TINY_PREFIX
from ..config import torch_dtype
from ..errors import ConfigError
from ..files import check_model_source, written_atomically
from ..spec import ContextSpec
from ..synth_data.utk import add_utk_tokens
from .schema import Recipe
from .validate import build_spec

if TYPE_CHECKING:  # transformers' classes are imported where they are used: `longpeft plan` needs none of them
    from transformers import BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase


def materialize_tiny_base(name: str, folder: Path, seed: int) -> Path:
    """Write the tiny model ``tiny:<arch>`` and its in-memory-trained tokenizer to ``folder`` (once,
    atomically: written beside it and renamed, so a kill or a full disk never leaves a partial base). Processes
    of one run may all call it at once: each builds the same base (seeded), the first rename wins, and the others
    use its folder."""
    import shutil
    import tempfile

    from ..tiny import demo_tokenizer, tiny_model

    if (folder / "config.json").is_file():
        return folder
    if folder.exists():  # an earlier write was cut short (a kill, a full disk): never use it
        shutil.rmtree(folder)
    arch = name[len(TINY_PREFIX) :]
    tokenizer = demo_tokenizer()
    model = tiny_model(arch, seed=seed, vocab_size=len(tokenizer))
    model.config.name_or_path = name
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".base-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(folder)  # atomic: the folder appears complete or not at all
        except OSError:
            if not (folder / "config.json").is_file():  # not another process's complete base: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def builds_partitioned(recipe: Recipe) -> bool:
    """Whether loading the base builds it partitioned across processes (DeepSpeed ZeRO-3's ``zero.Init``, which
    transformers uses for unquantized models under a ZeRO-3 config with ``zero3_init_flag``): a collective step."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled() and not recipe.model.load_in_4bit


def base_location(recipe: Recipe, output_dir: Path) -> str:
    """Hub id or local folder of the base model (tiny models are written under ``output_dir/base``;
    built-in models such as ``longpeft:toy-base`` are packaged folders)."""
    from ..builtin_models import model_location

    name = recipe.model.name_or_path
    if name.startswith(TINY_PREFIX):
        return str(materialize_tiny_base(name, output_dir / "base", recipe.train.seed))
    return model_location(name)


def check_base_source(recipe: Recipe) -> None:
    """``model.name_or_path`` before anything loads: a local folder must exist, a Hub id must answer within
    ``LONGPEFT_HUB_TIMEOUT`` (:func:`~longpeft.files.check_model_source`); a ``tiny:`` model is built here."""
    from ..builtin_models import model_location

    name = recipe.model.name_or_path
    if not name.startswith(TINY_PREFIX):
        check_model_source(model_location(name), "model.name_or_path", "; point it at the base model's folder")


def quantization_config(recipe: Recipe) -> BitsAndBytesConfig | None:
    """4-bit NF4 (QLoRA) settings; quant storage equals the compute dtype (needed by FSDP2)."""
    if not recipe.model.load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    dtype = torch_dtype(recipe.model.dtype)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=recipe.model.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=recipe.model.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )


def method_parameters(recipe: Recipe, model: Any) -> dict[str, Any]:
    """The own weights (Activation Beacon's) of every method the recipe applies, or none."""
    parameters: dict[str, Any] = {}
    for name in recipe.method_configs():
        parameters.update(METHODS[name].weight_parameters(model))
    return parameters


def attention_implementation(requested: str) -> str:
    """The requested attention kernel, or SDPA (with a warning) when flash-attn cannot run here."""
    if requested != "flash_attention_2":
        return requested
    import importlib.util

    if torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None:
        return requested
    warnings.warn(
        "model.attn_implementation=flash_attention_2 needs CUDA and the flash-attn package "
        "(pip install 'longpeft[flash-attn]'); using sdpa instead",
        stacklevel=2,
    )
    return "sdpa"


def configure_base(recipe: Recipe, base_id: str) -> tuple[PreTrainedTokenizerBase, Any, ContextSpec]:
    """Tokenizer, the base config carrying the recipe's new RoPE parameters and length, and the ContextSpec.

    transformers v5 reads ``rope_parameters`` when a model is built, so the config gets the complete dict
    (and ``max_position_embeddings`` >= the training length) before any model exists.
    """
    from transformers import AutoConfig, AutoTokenizer

    m = recipe.model
    common = dict(revision=m.revision, trust_remote_code=m.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(base_id, **common)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    config = AutoConfig.from_pretrained(base_id, **common)
    spec = build_spec(recipe, config, base_id)  # the recipe was validated against this config (validate.py)
    if recipe.data.utk is not None:  # UtK's knot, label and trace tokens join the vocabulary
        add_utk_tokens(tokenizer, max(recipe.data.utk.chunk_counts))
        spec.vocab_size = max(len(tokenizer), config.vocab_size)
    config.rope_parameters = dict(spec.rope_parameters)
    config.max_position_embeddings = spec.max_position_embeddings
    return tokenizer, config, spec


def finish_base(recipe: Recipe, model: PreTrainedModel) -> None:
    """Settings every backend gives the loaded model: the recipe's eos ids, no KV cache while training."""
    if recipe.model.eos_token_ids:
        model.generation_config.eos_token_id = list(recipe.model.eos_token_ids)
    model.config.use_cache = False


def load_base(recipe: Recipe, base_id: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, ContextSpec]:
    """Load tokenizer and model, give the model the recipe's ContextSpec, set its eos ids."""
    from transformers import AutoModelForCausalLM

    m = recipe.model
    tokenizer, config, spec = configure_base(recipe, base_id)
    model = AutoModelForCausalLM.from_pretrained(
        base_id,
        config=config,
        dtype=torch_dtype(m.dtype),
        attn_implementation=attention_implementation(m.attn_implementation),
        quantization_config=quantization_config(recipe),
        revision=m.revision,
        trust_remote_code=m.trust_remote_code,
    )
    # Then apply the spec (all but inference-time methods), which re-checks that the rotary frequencies changed.
    apply_spec(model, spec, training=True)
    if spec.vocab_size > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(spec.vocab_size)
    finish_base(recipe, model)
    return model, tokenizer, spec


def has_tied_embeddings(model: PreTrainedModel) -> bool:
    """Whether the model's output head shares its weight with the input embedding."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


def lora_config(recipe: Recipe, model: PreTrainedModel | None = None):
    """peft LoraConfig of the recipe (None for full fine-tuning).

    On a model with tied input/output embeddings a trained embedding stays tied to the output head: the adapter
    trains one matrix, and the merged model is tied as the base was. A fully trained one needs
    ``ensure_weight_tying``; peft ties trained rows (``token_indices``) by itself, and the flag there only warns.
    ``lora.embeddings: token_indices`` is refused on a tied head with a bias: peft's trainable tokens drop it.
    """
    from peft import LoraConfig

    if recipe.finetune != "lora":
        return None
    lora = recipe.lora
    tied = model is not None and has_tied_embeddings(model)
    if tied and lora.embeddings == "token_indices" and model.get_output_embeddings().bias is not None:
        raise ConfigError(
            f"recipe {recipe.name}: lora.embeddings: token_indices on a base whose tied output head has a bias: "
            "peft's trainable tokens leave the bias out of the head's forward; use lora.embeddings: full"
        )
    embedding = input_embedding_path(model) if model is not None else "embed_tokens"
    return LoraConfig(
        ensure_weight_tying=tied and lora.embeddings == "full",
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        modules_to_save=[embedding] if lora.embeddings == "full" else None,
        trainable_token_indices={embedding: list(lora.trainable_token_indices)}
        if lora.embeddings == "token_indices"
        else None,
        task_type="CAUSAL_LM",
    )


def input_embedding_path(model: PreTrainedModel) -> str:
    """The input embedding's module path (e.g. ``model.embed_tokens``): peft matches module names by suffix, and a
    bare ``embed_tokens`` also matched Activation Beacon's one-row ``beacon_embed_tokens``."""
    embedding = model.get_input_embeddings()
    return next(name for name, module in model.named_modules() if module is embedding)


def expose_token_indices_head_bias(model: Any) -> None:
    """Give the output head that peft wraps for ``lora.embeddings: token_indices`` on a tied base the ``bias``
    TRL's fused LM head reads (no-op for any other head).

    peft wraps such a head in a ``TrainableTokensWrapper`` tied to the embedding's trained rows. Its ``weight`` is
    already the effective ``[vocab, hidden]`` matrix (the base's rows with the trained ``trainable_token_indices``
    rows copied in, differentiable in them) that its own forward multiplies by, but it has no ``bias``, which TRL's
    fused loss reads beside ``weight`` (``AttributeError`` on the first step). Its forward adds no bias
    (``F.linear(hidden, weight)``; :func:`lora_config` refuses heads that have one), so ``bias = None`` makes the
    fused loss the loss of the model's own forward.
    """
    from peft.utils.other import TrainableTokensWrapper

    head = model.get_output_embeddings()
    if isinstance(head, TrainableTokensWrapper):
        head.bias = None


def keep_trained_weights_in(model: Any, dtype: torch.dtype, compute_dtype: torch.dtype) -> None:
    """Keep every trained weight of ``model`` in ``dtype`` (``lora.trainable_dtype``) while the forward computes in
    ``compute_dtype``.

    TRL casts trained weights to bfloat16 over a 4-bit base, peft's trainable embedding copy starts in the
    base's dtype, and a full fine-tune of a bf16 model would train its bf16 weights themselves; either way AdamW
    would then drop updates smaller than bfloat16's precision (at lr 2e-5 on a tiny model, 74 % of the weights of a
    full fine-tune never moved in 3 steps). The forward runs under the compute dtype's autocast. The input
    embedding's output is cast to ``compute_dtype`` so that a float32 embedding copy does not turn the residual
    stream (and every checkpointed layer input, ``[batch, seq, hidden]``) into float32.
    """
    for parameter in model.parameters():
        if parameter.requires_grad and parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    embeddings = model.get_input_embeddings()
    if dtype != compute_dtype and any(p.requires_grad for p in embeddings.parameters()):
        embeddings.register_forward_hook(lambda module, args, output: output.to(compute_dtype))


def adapter_settings(model: Any) -> dict[str, Any] | None:
    """The LoRA config of the trained adapter (whichever backend added it); None for full fine-tuning."""
    configs = getattr(model, "peft_config", None) or {}
    return configs["default"].to_dict() if "default" in configs else None


def gathered_state_dict(trainer: Any) -> dict[str, Any] | None:
    """The whole state dict of a model sharded across processes (FSDP, DeepSpeed ZeRO-3), gathered by accelerate
    with every process taking part (call it on all of them); None when each process holds the whole model."""
    if trainer.is_fsdp_enabled:
        return trainer.accelerator.get_state_dict(trainer.model)
    if trainer.is_deepspeed_enabled:
        return trainer.accelerator.get_state_dict(trainer.deepspeed)
    return None


def save_adapter(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    spec: ContextSpec,
    adapter_dir: Path,
    state_dict: dict[str, Any] | None = None,
    finetune: str = "lora",
    dtype: torch.dtype = torch.float32,
) -> None:
    """Adapter weights (or the full model), method weights, tokenizer, generation config, longpeft.json and the
    model card.

    LoRA weights are in peft's own format (a trained embedding tied to the head under both its names), and both
    longpeft.json and adapter_config.json name the base as :func:`~.validate.spec_base_reference` does (no path of this
    machine). When the spec changes what plain ``PeftModel.from_pretrained`` cannot know (the RoPE parameters, a
    method applied at load), a warning says what it would leave out.

    ``state_dict``: the gathered weights of a sharded model (:func:`gathered_state_dict`); peft keeps the
    adapter's part of it. A fully fine-tuned model is saved in ``dtype`` (the recipe's ``model.dtype``; it trained
    float32 weights) and also gets what its methods export (e.g. HARPE's modeling
    file that plain transformers needs to keep its per-head bases, ``trust_remote_code=True``). With
    ``finetune: method`` only the method's own weights are written (the base did not change). longpeft.json
    records which (``weights``: the ``finetune`` setting).

    The folder is written beside ``adapter_dir`` and swapped in once complete (a full disk leaves the one before, or
    none: never a folder that looks complete); a full disk or a refused write is an ``OutputWriteError``.
    """
    adapter_dir = Path(adapter_dir).absolute()
    with written_atomically(adapter_dir, _saved_bytes(model, state_dict), replace=True) as partial:
        _save_adapter_files(model, tokenizer, spec, partial, adapter_dir, state_dict, finetune, dtype)
    from ..hub import plain_peft_misses

    missed = plain_peft_misses(spec) if finetune == "lora" else []
    if missed:
        warnings.warn(
            f"{adapter_dir} is in peft's own format, but plain PeftModel.from_pretrained on the stock base leaves "
            f"out what its longpeft.json holds: {'; '.join(missed)}; load it with longpeft.load (its model card "
            "says so too)",
            stacklevel=2,
        )


def _saved_bytes(model: Any, state_dict: dict[str, Any] | None) -> int:
    """About what the saved weights take: the trainable parameters (or the gathered ``state_dict``), and a tied
    embedding's second name in peft's format."""
    tensors = state_dict.values() if state_dict else (p for p in model.parameters() if p.requires_grad)
    return sum(t.numel() * t.element_size() for t in tensors) + tied_copies_bytes(model)


def _save_adapter_files(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    spec: ContextSpec,
    folder: Path,
    adapter_dir: Path,
    state_dict: dict[str, Any] | None,
    finetune: str,
    dtype: torch.dtype,
) -> None:
    """:func:`save_adapter`'s files, written into ``folder`` (its card names ``adapter_dir``)."""
    if finetune == "full":
        model.config.use_cache = True  # training turned it off; the saved model is for generation
        # the float32 weights it trained are saved in the model's dtype (buffers such as inv_freq stay as they are)
        for parameter in model.parameters():
            if parameter.is_floating_point():
                parameter.data = parameter.data.to(dtype)
        if state_dict is not None:
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
    if finetune != "method":
        model.save_pretrained(folder, **({"state_dict": state_dict} if state_dict is not None else {}))
        write_tied_copies(folder, tied_copies(model))  # peft's own format: a tied embedding under every name
    save_method_weights(model, spec, folder, state_dict)
    if finetune == "full":
        export_methods(model, spec, folder)
    tokenizer.save_pretrained(folder)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(folder)
    spec = spec.model_copy(update={"weights": finetune})
    spec.save(folder)
    from ..hub import name_base_in_adapter_config, write_model_card

    name_base_in_adapter_config(folder, spec.base_model)  # as longpeft.json does: no path of this machine
    write_model_card(folder, spec, folder_name=adapter_dir.name)  # replaces peft's placeholder README.md
