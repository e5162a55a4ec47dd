"""The base model of a recipe, loaded for training (a Hub model, a local folder or a generated ``tiny:`` one) with
its ContextSpec applied, by transformers or unsloth's backend (:mod:`.unsloth_backend`)."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    BitsAndBytesConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.integrations import is_deepspeed_zero3_enabled

from ..adapters import apply_spec
from ..base_config import TINY_PREFIX, model_location
from ..config import torch_dtype
from ..files import check_model_source
from ..launch import check_sharded
from ..spec import ContextSpec
from ..synth_data.utk import add_utk_tokens
from ..tiny import demo_tokenizer, tiny_model
from .schema import Recipe
from .validate import build_spec

# Loads a recipe's base: ``(recipe, base_id) -> (model, tokenizer, spec)`` (:func:`load_base`, or unsloth's).
BaseLoader = Callable[[Recipe, str], tuple[Any, PreTrainedTokenizerBase, ContextSpec]]


def check_base_source(recipe: Recipe) -> None:
    """``model.name_or_path`` before anything loads: a local folder must exist, a Hub id must answer within
    ``LONGPEFT_HUB_TIMEOUT``; a ``tiny:`` model is built later."""
    name = recipe.model.name_or_path
    if not name.startswith(TINY_PREFIX):
        check_model_source(model_location(name), "model.name_or_path", "; point it at the base model's folder")


def base_location(recipe: Recipe, output_dir: Path) -> str:
    """Hub id or local folder of the base model (a ``tiny:`` model is written to ``output_dir/base``)."""
    name = recipe.model.name_or_path
    if name.startswith(TINY_PREFIX):
        return str(materialize_tiny_base(name, output_dir / "base", recipe.train.seed))
    return model_location(name)


def materialize_tiny_base(name: str, folder: Path, seed: int) -> Path:
    """Write the tiny model ``tiny:<arch>`` and its in-memory-trained tokenizer to ``folder``, once and atomically
    (written beside it and renamed). Processes of one run may all call it: the first rename wins."""
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


def quantization_config(recipe: Recipe) -> BitsAndBytesConfig | None:
    """4-bit NF4 (QLoRA) settings; quant storage equals the compute dtype (needed by FSDP2)."""
    if not recipe.model.load_in_4bit:
        return None
    dtype = torch_dtype(recipe.model.dtype)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=recipe.model.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=recipe.model.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=dtype,
    )


def attention_implementation(requested: str) -> str:
    """The requested attention kernel, or SDPA (with a warning) when flash-attn cannot run here."""
    runs_here = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
    if requested != "flash_attention_2" or runs_here:
        return requested
    warnings.warn(
        "model.attn_implementation=flash_attention_2 needs CUDA and the flash-attn package "
        "(pip install 'longpeft[flash-attn]'); using sdpa instead",
        stacklevel=2,
    )
    return "sdpa"


def configure_base(recipe: Recipe, base_id: str) -> tuple[PreTrainedTokenizerBase, Any, ContextSpec]:
    """Tokenizer, the base config carrying the recipe's complete RoPE parameters and positions (transformers reads
    them when a model is built), and the ContextSpec."""
    common = dict(revision=recipe.model.revision, trust_remote_code=recipe.model.trust_remote_code)
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
    apply_spec(model, spec, training=True)
    if spec.vocab_size > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(spec.vocab_size)
    finish_base(recipe, model)
    return model, tokenizer, spec


def load_model(
    recipe: Recipe, base_id: str, args: Any, loader: BaseLoader = load_base
) -> tuple[Any, PreTrainedTokenizerBase, ContextSpec]:
    """The base with the recipe's methods applied, through ``loader`` (:func:`load_base`, or unsloth's, which adds
    LoRA too), after the local main process (which downloads it once); all at once when DeepSpeed ZeRO-3 partitions
    the weights as the model is built, a method that cannot train sharded refused first. ``args``: the run's
    training arguments."""
    partitioned = is_deepspeed_zero3_enabled() and not recipe.model.load_in_4bit
    if partitioned:
        check_sharded(recipe, "DeepSpeed ZeRO-3")
    with nullcontext() if partitioned else args.main_process_first(local=True, desc="base model"):
        return loader(recipe, base_id)
