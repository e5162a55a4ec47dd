"""The recipe schema: a YAML file validated by typed models; unknown keys and invalid values fail with the key's
dotted path (``lora.rank: unknown key``).

The method sections (``rope``, ``harpe``, ...) are the configs of the registered methods
(``longpeft.adapters.registry``), added by :func:`recipe_model`. ``trl:`` passes other ``trl.SFTConfig`` arguments.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, create_model, field_validator, model_validator

from ..adapters import METHODS, LongSamples, check_conflicts, find_conflicts
from ..adapters.registry import COLLATOR
from ..base_config import optimizer_names
from ..config import (
    MAX_POSITIONS,
    ConfigError,
    Positions,
    StrictModel,
    apply_overrides,
    bundled_names,
    file_or_bundled,
    format_validation_error,
    read_yaml,
)


class ModelSection(StrictModel):
    """The base model and how to load it. ``name_or_path``: a Hub id, a local folder, or ``tiny:<arch>`` (a tiny
    random model with a tokenizer trained in memory: longpeft.tiny)."""

    name_or_path: str
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = "sdpa"
    load_in_4bit: bool = False
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"
    bnb_4bit_use_double_quant: bool = True
    eos_token_ids: list[int] | None = None  # every token id that ends generation (Llama-3-Instruct: 128001, 128009)
    trust_remote_code: bool = False
    # an earlier run's adapter folder (or run folder, or Hub repo) whose trained weights this run starts from
    init_from: str | None = None


class LoraSection(StrictModel):
    """LoRA settings. ``embeddings``: ``full`` trains the whole input embedding, ``token_indices`` only the rows in
    ``trainable_token_indices``, ``none`` neither. ``trainable_dtype``: docs/recipes.md."""

    r: int = Field(default=32, gt=0)
    alpha: float = Field(default=16, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    embeddings: Literal["full", "token_indices", "none"] = "full"
    trainable_token_indices: list[int] | None = None
    trainable_dtype: Literal["float32", "bfloat16"] | None = None  # of trained weights and AdamW state (float32)

    @model_validator(mode="after")
    def _indices_need_mode(self) -> LoraSection:
        if self.embeddings == "token_indices" and not self.trainable_token_indices:
            raise ValueError("embeddings: token_indices needs a non-empty trainable_token_indices list")
        if self.embeddings != "token_indices" and self.trainable_token_indices:
            raise ValueError("trainable_token_indices is only used with embeddings: token_indices")
        return self


class UtkSection(StrictModel):
    """Untie-the-Knots augmentation of plain text, on the fly: packed sequences augmented with ``probability``,
    documents of ``min_split_tokens`` or more split into ``h`` chunks (``chunk_counts``: ``{h: weight}``), knotted,
    shuffled (``preserve_order`` keeps each document's order), followed by their backtraces; each chunk of a
    sequence labelled by ``label_length`` letters."""

    probability: float = Field(default=0.8, ge=0, le=1)
    chunk_counts: dict[int, float] = Field(default_factory=lambda: {2: 0.5, 3: 0.5})
    min_split_tokens: int = Field(default=64, ge=2)
    preserve_order: bool = True
    label_length: int = Field(default=4, ge=1, le=16)

    @field_validator("chunk_counts")
    @classmethod
    def _counts(cls, value: dict[int, float]) -> dict[int, float]:
        weights = value.values()
        if not value or not 1 <= min(value) <= max(value) <= 8 or min(weights) < 0 or not sum(weights):
            raise ValueError("chunk_counts maps chunk counts 1..8 to non-negative weights with a positive sum")
        return value


class RetrievalSection(StrictModel):
    """The built-in retrieval documents (``data.source: retrieval``: longpeft.synth_data.retrieval_docs),
    ``n_documents`` of ``min_tokens`` to ``max_tokens`` tokens, mixed by ``mix`` (kind -> weight)."""

    n_documents: int = Field(default=256, gt=0, le=1_000_000)
    min_tokens: Positions = 512
    max_tokens: Positions = 1024
    seed: int = 0
    mix: dict[Literal["passkey", "niah", "induction"], float] | None = None

    @model_validator(mode="after")
    def _lengths(self) -> RetrievalSection:
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be <= max_tokens")
        if self.mix is not None and (any(w < 0 for w in self.mix.values()) or not sum(self.mix.values())):
            raise ValueError("mix maps kinds to non-negative weights with a positive sum")
        return self


class DemoSection(StrictModel):
    """The procedural demo set (``data.source: demo``); a setting left out takes ``build_demo_dataset``'s default."""

    n_conversations: int | None = Field(default=None, gt=0, le=1_000_000)
    context_tokens: Positions | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**32)
    questions_per_conversation: int | None = Field(default=None, gt=0, le=1000)


class DataSection(StrictModel):
    """Training data: conversations (``format: messages``, loss on assistant turns) or plain text (``format: text``,
    loss on every token). ``source``: a .jsonl/.json file or folder of them, a Hub dataset id, ``demo`` or
    ``retrieval``. Samples longer than ``max_length`` tokens are dropped (``truncate: true`` cuts them), and those
    shorter than ``min_length``."""

    source: str
    split: str = "train"
    format: Literal["messages", "text"] = "messages"
    messages_field: str = "messages"
    text_field: str = "text"
    max_length: Positions
    min_length: int = Field(default=0, ge=0, le=MAX_POSITIONS)
    truncate: bool = False
    max_samples: int | None = Field(default=None, gt=0)
    demo: DemoSection = DemoSection()
    retrieval: RetrievalSection | None = None
    utk: UtkSection | None = None

    @model_validator(mode="after")
    def _consistent(self) -> DataSection:
        if self.min_length > self.max_length:
            raise ValueError(f"data.min_length ({self.min_length}) is above data.max_length ({self.max_length})")
        if self.utk is not None and self.format != "text":
            raise ValueError("data.utk augments plain text (documents); set data.format: text")
        return self


class TrainSection(StrictModel):
    """Optimisation. ``global_batch_size`` = per-device batch x devices x gradient accumulation (derived at launch)."""

    learning_rate: float = Field(gt=0)
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    warmup_steps: int = Field(default=0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    optim: str = "adamw_torch"  # a transformers optimizer name (OptimizerNames)
    per_device_batch_size: int = Field(default=1, gt=0)
    global_batch_size: int = Field(default=8, gt=0)
    num_train_epochs: float = Field(default=1.0, gt=0)
    max_steps: int = -1  # > 0 overrides num_train_epochs
    gradient_checkpointing: bool = True
    activation_offloading: bool = False  # checkpointed activations in CPU memory (TRL's offloader)
    checkpoint_layers: Literal["auto", "all"] | int = "all"  # layers checkpointed (the first N): docs/scale.md
    keep_attention: Literal["auto", "all", "none"] | int = "none"  # checkpointed layers keeping attention's output
    offload_checkpoints: bool = False  # checkpointed layer inputs in pinned CPU memory (scale/checkpointing.py)
    mlp_tile_tokens: int | None = Field(default=None, gt=0, le=MAX_POSITIONS)  # tokens per MLP tile; null: untiled
    memory_budget_gib: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # for auto; default 95 % of GPU
    use_liger_kernel: bool = False  # Liger's Triton kernels for RMSNorm, SwiGLU and RoPE (CUDA, liger-kernel)
    group_by_length: bool = False  # batches of similar lengths (docs/recipes.md)
    save_steps: int = Field(default=50, gt=0)
    save_total_limit: int | None = Field(default=2, gt=0)
    logging_steps: int = Field(default=1, gt=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    seed: int = Field(default=42, ge=0, lt=2**32)  # torch, numpy and the training order
    assistant_only_loss: bool | None = None  # None: on for messages data, off for text (set by the validation)
    report_to: list[str] = []
    backend: Literal["transformers", "unsloth"] = "transformers"  # unsloth: its FastLanguageModel (CUDA only)

    @field_validator("max_steps")
    @classmethod
    def _max_steps(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("max_steps must be -1 (use num_train_epochs) or > 0")
        return value

    @field_validator("checkpoint_layers", "keep_attention")
    @classmethod
    def _layer_count(cls, value: str | int) -> str | int:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be a number of layers >= 0, or one of the words the field allows")
        return value

    @field_validator("optim")
    @classmethod
    def _known_optimizer(cls, value: str) -> str:
        names = optimizer_names()
        if value not in names:
            raise ValueError(f"{value!r} is not a transformers optimizer; use one of {', '.join(names)}")
        return value

    @model_validator(mode="after")
    def _checkpointing(self) -> TrainSection:
        changed = changed_from_default(self, ("checkpoint_layers", "keep_attention", "offload_checkpoints"))
        if changed and not self.gradient_checkpointing:
            raise ValueError(
                f"train.{changed[0]} shapes activation checkpointing, which "
                "train.gradient_checkpointing: false turns off; set it to true"
            )
        if self.offload_checkpoints and self.activation_offloading:
            raise ValueError(
                "train.offload_checkpoints and train.activation_offloading both move checkpointed inputs "
                "to CPU memory; use one (offload_checkpoints moves only the layer inputs, ahead of time)"
            )
        if self.activation_offloading and (self.keep_attention != "none" or self.checkpoint_layers != "all"):
            raise ValueError(
                "train.activation_offloading offloads every saved activation, kept attention outputs "
                "and unchecked layers too; use train.offload_checkpoints with train.checkpoint_layers / "
                "train.keep_attention"
            )
        return self


def changed_from_default(section: StrictModel, keys: tuple[str, ...]) -> list[str]:
    """Those of ``keys`` that ``section`` sets to other than their default."""
    return [key for key in keys if getattr(section, key) != type(section).model_fields[key].default]


# The train settings SFTConfig takes as they are, under their own names (trainer.sft_arguments).
TRAIN_KEYS_AS_IS = (
    "learning_rate lr_scheduler_type warmup_steps weight_decay adam_beta1 adam_beta2 optim num_train_epochs max_steps "
    "save_steps save_total_limit logging_steps max_grad_norm seed activation_offloading"
).split()
# SFTConfig arguments longpeft sets itself (trainer.sft_arguments), with what to do instead.
TRL_KEYS_OWNED_BY_RECIPE = {
    **{key: f"use train.{key}" for key in TRAIN_KEYS_AS_IS},
    **{key: f"use train.{key}" for key in ("gradient_checkpointing", "assistant_only_loss", "report_to")},
    "use_liger_kernel": "use train.use_liger_kernel",
    "output_dir": "use output_dir",
    "per_device_train_batch_size": "use train.per_device_batch_size",
    "gradient_accumulation_steps": "use train.global_batch_size",
    "activation_checkpointing": "use train.gradient_checkpointing",
    "data_seed": "use train.seed",
    "max_length": "use data.max_length",
    "gradient_checkpointing_kwargs": "use train.checkpoint_layers, train.keep_attention and train.offload_checkpoints",
    "bf16": "use model.dtype",
    "fp16": "use model.dtype",
    "use_cpu": "it follows the machine (CPU when there is no CUDA)",
    "save_strategy": "checkpoints are written every train.save_steps steps",
    "packing": "TRL packing is not supported (data.utk packs its own sequences)",
    "dataloader_num_workers": "0, since the collators draw from their own generators",
    "disable_tqdm": "progress bars stay on",
    "dataset_kwargs": "data.utk prepares its sequences itself",
    "remove_unused_columns": "data.utk's collator reads doc_lengths",
    "save_only_model": "checkpoints keep the optimizer state, which --resume needs",
    "train_sampling_strategy": "use train.group_by_length (the order longpeft plan times)",
}


def check_unsloth_recipe(recipe: Recipe) -> None:
    """Refuse, naming the key, the settings the unsloth backend would not carry out (it replaces the attention and
    decoder forwards: the methods that patch them name ``unsloth`` in their registry ``conflicts``)."""
    problems = [
        f"{conflict.second} ({conflict.why})"
        for conflict in find_conflicts(recipe.method_configs(), {"unsloth": "train.backend: unsloth"})
    ]
    if recipe.finetune != "lora":
        problems.append(f"finetune: {recipe.finetune} (LoRA/QLoRA only)")
    if recipe.lora.embeddings == "token_indices":
        problems.append("lora.embeddings: token_indices (use full or none)")
    if recipe.data.utk is not None:
        problems.append("data.utk (it adds tokens and its own collator)")
    if recipe.train.activation_offloading:
        problems.append("train.activation_offloading (unsloth's gradient checkpointing already offloads)")
    memory_keys = ("checkpoint_layers", "keep_attention", "offload_checkpoints", "mlp_tile_tokens", "use_liger_kernel")
    memory = changed_from_default(recipe.train, memory_keys)
    if memory:
        problems.append(f"train.{memory[0]} (unsloth checkpoints its own way and picks its own kernels)")
    if recipe.lora.trainable_dtype is not None:
        problems.append("lora.trainable_dtype (unsloth keeps trained weights in the model's dtype)")
    if problems:
        raise ValueError(
            "train.backend: unsloth does not support " + "; ".join(problems) + "; use train.backend: transformers"
        )


class Recipe(StrictModel):
    """A whole recipe file (method sections added by :func:`recipe_model`). ``method``: the registered method it is
    about (its section required unless every setting has a default). ``finetune``: ``lora`` trains an adapter (QLoRA
    with model.load_in_4bit) and the methods' own weights; ``full`` every weight, saving a full model; ``method``
    only the methods' own weights, the base frozen and no LoRA."""

    name: str
    description: str = ""
    method: str = "rope"
    finetune: Literal["lora", "full", "method"] = "lora"
    model: ModelSection
    lora: LoraSection = LoraSection()
    data: DataSection
    train: TrainSection
    trl: dict[str, Any] = {}  # other trl.SFTConfig arguments, passed through
    target_length: Positions | None = None  # the length the adapter should work at
    output_dir: str = "runs/{name}"

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        if self.method not in METHODS:
            raise ValueError(f"method: {self.method!r} is not a registered method ({', '.join(METHODS)})")
        if getattr(self, self.method, None) is None:
            try:
                setattr(self, self.method, METHODS[self.method].config())
            except ValidationError:
                raise ValueError(f"method: {self.method} needs a {self.method} section") from None
        if self.data.format == "text" and self.train.assistant_only_loss:
            raise ValueError(
                "train.assistant_only_loss needs data.format: messages (plain text has no assistant turns)"
            )
        if self.train.assistant_only_loss is None:  # the effective value, in plan's output and the run's record
            self.train.assistant_only_loss = self.data.format == "messages"
        if self.data.format == "text" and self.data.source == "demo":
            raise ValueError("data.source: demo is conversations; use data.format: messages")
        if self.data.source == "retrieval" and self.data.format != "text":
            raise ValueError("data.source: retrieval is plain text; use data.format: text")
        if self.data.retrieval is not None and self.data.source != "retrieval":
            raise ValueError("data.retrieval configures data.source: retrieval; remove it or set that source")
        configs = self.method_configs()
        check_conflicts(configs, {COLLATOR: "data.utk"} if self.data.utk is not None else {})
        samples = self.long_samples()
        if samples is not None and self.data.format != "text":
            raise ValueError(
                f"{samples.setting} skips stretches of text, which would cut a conversation's context "
                f"from its answers; use it with data.format: text, or {samples.off}"
            )
        if self.data.utk is not None and self.finetune == "lora" and self.lora.embeddings == "none":
            raise ValueError(
                "data.utk adds special tokens whose embedding rows must train; set lora.embeddings: full (or "
                "token_indices)"
            )
        if self.data.utk is not None and self.finetune == "method":
            raise ValueError("data.utk adds special tokens whose embedding rows must train; use finetune: lora")
        if self.finetune in ("full", "method") and self.model.load_in_4bit:
            raise ValueError(
                f"finetune: {self.finetune} cannot train over a 4-bit model (transformers' Trainer "
                "refuses a quantized model without LoRA); use finetune: lora (QLoRA)"
            )
        if self.finetune == "method" and not any(METHODS[name].keeps_weights for name in configs):
            raise ValueError(
                "finetune: method trains the methods' own weights, and this recipe's "
                f"{' + '.join(configs)} has none; use finetune: lora or full"
            )
        if self.train.backend == "unsloth":
            check_unsloth_recipe(self)
        for key in self.trl:
            if key in TRL_KEYS_OWNED_BY_RECIPE:
                raise ValueError(f"trl.{key} is set by longpeft: {TRL_KEYS_OWNED_BY_RECIPE[key]}")
        return self

    def method_configs(self) -> dict[str, StrictModel]:
        """The method sections present in the recipe, in registry order, and the implied methods' (RoPE) always."""
        configs = {
            name: getattr(self, name, None) or (method.config() if method.implied else None)
            for name, method in METHODS.items()
        }
        return {name: config for name, config in configs.items() if config is not None}

    def long_samples(self) -> LongSamples | None:
        """The samples longer than ``data.max_length`` a method's collator takes (``long_samples`` hook), or None."""
        for name, config in self.method_configs().items():
            samples = METHODS[name].long_samples(config, self.target_length)
            if samples is not None:
                return samples
        return None

    def resolved_output_dir(self) -> Path:
        return Path(self.output_dir.format(name=self.name))


def recipe_model() -> type[Recipe]:
    """The recipe model with one optional section per registered method."""
    return _recipe_model(tuple((name, method.config) for name, method in METHODS.items()))


@lru_cache(maxsize=8)
def _recipe_model(sections: tuple[tuple[str, type], ...]) -> type[Recipe]:
    fields = {name: (config | None, None) for name, config in sections}
    return create_model("Recipe", __base__=Recipe, **fields)


class RecipeError(ConfigError):
    """A recipe file that cannot be used; the message names the file and the key."""


def parse_recipe(data: dict[str, Any], source: str = "<recipe>") -> Recipe:
    """Validate a recipe dict; raises RecipeError naming every bad key."""
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe must be a YAML mapping, got {type(data).__name__}")
    model = recipe_model()
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message = format_validation_error(source, exc, model)
        raise RecipeError(message.replace("invalid settings", "invalid recipe", 1)) from None


def load_recipe(path_or_name: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load a recipe from a YAML path or the name of a bundled recipe (e.g. ``tiny-cpu``), with ``overrides``
    (``dotted.key=value`` strings, values parsed as YAML, e.g. ``train.max_steps=10``) applied before validation."""
    try:
        path = file_or_bundled(path_or_name, Path(__file__).parent, "recipe")
        data = read_yaml(path)
        if isinstance(data, dict):  # else parse_recipe refuses it
            apply_overrides(data, overrides, str(path))
    except ConfigError as exc:
        raise RecipeError(str(exc)) from None
    return parse_recipe(data, str(path))


def bundled_recipes() -> list[str]:
    """Names of the recipes shipped with longpeft."""
    return bundled_names(Path(__file__).parent)
