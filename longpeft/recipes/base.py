"""The base model of a recipe, loaded for training: a Hub model, a local folder or a generated ``tiny:`` one, its
ContextSpec and the methods applied to it, 4-bit quantization, and the backend that loads it (transformers, or
unsloth's, which adds LoRA too: :mod:`.unsloth_backend`).
"""

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
    ``LONGPEFT_HUB_TIMEOUT`` (:func:`~longpeft.files.check_model_source`); a ``tiny:`` model is built later
    (:func:`base_location`)."""
    name = recipe.model.name_or_path
    if not name.startswith(TINY_PREFIX):
        check_model_source(model_location(name), "model.name_or_path", "; point it at the base model's folder")


def base_location(recipe: Recipe, output_dir: Path) -> str:
    """Hub id or local folder of the base model (tiny models are written under ``output_dir/base``;
    built-in models such as ``longpeft:toy-base`` are packaged folders)."""
    name = recipe.model.name_or_path
    if name.startswith(TINY_PREFIX):
        return str(materialize_tiny_base(name, output_dir / "base", recipe.train.seed))
    return model_location(name)


def materialize_tiny_base(name: str, folder: Path, seed: int) -> Path:
    """Write the tiny model ``tiny:<arch>`` and its in-memory-trained tokenizer to ``folder`` (once,
    atomically: written beside it and renamed, so a kill or a full disk never leaves a partial base). Processes
    of one run may all call it at once: each builds the same base (seeded), the first rename wins, and the others
    use its folder."""
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
    return is_deepspeed_zero3_enabled() and not recipe.model.load_in_4bit


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
    if requested != "flash_attention_2":
        return requested
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


def load_model(
    recipe: Recipe, base_id: str, args: Any, loader: BaseLoader = load_base
) -> tuple[Any, PreTrainedTokenizerBase, ContextSpec]:
    """The base with the recipe's methods applied, through ``loader`` (:func:`load_base`; unsloth's also adds LoRA:
    :func:`~.unsloth_backend.load_model`). ``args``: the run's training arguments, which set up the processes.

    Each process loads the base after the local main one (which downloads it once), except under DeepSpeed ZeRO-3,
    whose zero.Init partitions every weight while the model is built, with all processes taking part; a method that
    cannot train sharded is refused before then (it would read partitioned, empty weights).
    """
    partitioned = builds_partitioned(recipe)
    if partitioned:
        check_sharded(recipe, "DeepSpeed ZeRO-3")
    with nullcontext() if partitioned else args.main_process_first(local=True, desc="base model"):
        return loader(recipe, base_id)
