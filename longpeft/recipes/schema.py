"""The recipe schema: a YAML file validated by typed models.

Unknown keys and invalid values fail with the dotted path of the key (``lora.rank: unknown key``).
A recipe is one readable document; the runner (runner.py) turns it into a model, data and trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ModelSection(Section):
    """The base model and how to load it.

    ``name_or_path`` is a Hub id, a local folder, or ``tiny:<arch>`` for a tiny random model built
    from a config with a tokenizer trained in memory (tests, demo; see longpeft.tiny).
    """

    name_or_path: str
    revision: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    attn_implementation: Literal["eager", "sdpa", "flash_attention_2"] = "sdpa"
    load_in_4bit: bool = False
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"
    bnb_4bit_use_double_quant: bool = True
    eos_token_ids: list[int] | None = Field(
        default=None, description="every token id that ends generation (Llama-3-Instruct: 128001 and 128009)"
    )
    trust_remote_code: bool = False


class RopeSection(Section):
    """New RoPE parameters (merged onto the base's) and the new context length."""

    rope_type: Literal["default", "linear", "dynamic", "yarn", "llama3"] | None = None
    rope_theta: float | None = Field(default=None, gt=1)
    factor: float | None = Field(default=None, gt=0)
    original_max_position_embeddings: int | None = Field(default=None, gt=0)
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    max_position_embeddings: int | None = Field(default=None, gt=0)

    def rope_parameters(self) -> dict[str, Any]:
        """The requested rope_parameters keys (without max_position_embeddings), Nones dropped."""
        return {k: v for k, v in self.model_dump().items() if v is not None and k != "max_position_embeddings"}


class LoraSection(Section):
    """LoRA settings. ``embeddings``: ``full`` trains the whole input embedding (the paper),
    ``token_indices`` only the rows in ``trainable_token_indices`` (small adapters), ``none`` neither."""

    r: int = Field(default=32, gt=0)
    alpha: float = Field(default=16, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    embeddings: Literal["full", "token_indices", "none"] = "full"
    trainable_token_indices: list[int] | None = None

    @model_validator(mode="after")
    def _indices_need_mode(self) -> LoraSection:
        if self.embeddings == "token_indices" and not self.trainable_token_indices:
            raise ValueError("embeddings: token_indices needs a non-empty trainable_token_indices list")
        if self.embeddings != "token_indices" and self.trainable_token_indices:
            raise ValueError("trainable_token_indices is only used with embeddings: token_indices")
        return self


class DataSection(Section):
    """Training data: conversations (``format: messages``, loss on assistant turns) or plain text
    (``format: text``, loss on every token, e.g. continual pretraining).

    ``source``: a .jsonl/.json file or folder of them, a Hub dataset id, or ``demo`` (the offline
    procedural QA set generated on the fly). Samples longer than ``max_length`` tokens are dropped
    (``truncate: true`` cuts them instead).
    """

    source: str
    split: str = "train"
    format: Literal["messages", "text"] = "messages"
    messages_field: str = "messages"
    text_field: str = "text"
    max_length: int = Field(gt=0)
    truncate: bool = False
    max_samples: int | None = Field(default=None, gt=0)
    demo: dict[str, Any] = Field(
        default_factory=dict, description="options of the procedural demo set (n_conversations, context_tokens, seed)"
    )


class TrainSection(Section):
    """Optimisation. ``global_batch_size`` = per-device batch x devices x gradient accumulation;
    the accumulation is derived at launch from the number of processes."""

    learning_rate: float = Field(gt=0)
    lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear"
    warmup_steps: int = Field(default=0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    optim: str = "adamw_torch"
    per_device_batch_size: int = Field(default=1, gt=0)
    global_batch_size: int = Field(default=8, gt=0)
    num_train_epochs: float = Field(default=1.0, gt=0)
    max_steps: int = Field(default=-1, description="> 0 overrides num_train_epochs")
    gradient_checkpointing: bool = True
    save_steps: int = Field(default=50, gt=0)
    save_total_limit: int | None = Field(default=2, gt=0)
    logging_steps: int = Field(default=1, gt=0)
    max_grad_norm: float = Field(default=1.0, gt=0)
    seed: int = 42
    assistant_only_loss: bool | None = Field(
        default=None, description="loss on assistant turns only; default: on for messages data, off for text"
    )
    report_to: list[str] = []

    @field_validator("max_steps")
    @classmethod
    def _max_steps(cls, value: int) -> int:
        if value == 0 or value < -1:
            raise ValueError("max_steps must be -1 (use num_train_epochs) or > 0")
        return value


class HarpeSection(Section):
    """HARPE: one RoPE base per KV head, chosen when the adapter is created (see adapters/harpe.py).

    ``selection``: ``peak_valley`` (the paper's greedy search on a ``stride`` grid) or ``uniform``
    (evenly spaced in [b_min, b_max], ascending or ``descending`` over the heads).
    """

    selection: Literal["peak_valley", "uniform"] = "peak_valley"
    b_min: float = Field(gt=1)
    b_max: float = Field(gt=1)
    stride: float | None = Field(default=None, gt=0)
    descending: bool = False

    @model_validator(mode="after")
    def _check_range(self) -> HarpeSection:
        if self.b_max < self.b_min:
            raise ValueError("b_max must be >= b_min")
        if self.selection == "peak_valley" and self.stride is None:
            raise ValueError("selection: peak_valley needs a stride (the candidate grid step)")
        return self


class Recipe(Section):
    """A whole recipe file.

    ``finetune``: ``lora`` trains an adapter (QLoRA when model.load_in_4bit); ``full`` trains every
    weight (HARPE's paper setting) and saves a full model with its longpeft.json.
    """

    name: str
    description: str = ""
    method: Literal["rope_base", "harpe"] = "rope_base"
    finetune: Literal["lora", "full"] = "lora"
    model: ModelSection
    rope: RopeSection = RopeSection()
    harpe: HarpeSection | None = None
    lora: LoraSection = LoraSection()
    data: DataSection
    train: TrainSection
    target_length: int | None = Field(default=None, gt=0, description="length the adapter should work at")
    output_dir: str = "runs/{name}"

    @model_validator(mode="after")
    def _method_sections(self) -> Recipe:
        if self.method == "harpe" and self.harpe is None:
            raise ValueError("method: harpe needs a harpe section (selection, b_min, b_max, stride)")
        if self.method != "harpe" and self.harpe is not None:
            raise ValueError(f"the harpe section is only used with method: harpe (method is {self.method})")
        if self.data.format == "text" and self.train.assistant_only_loss:
            raise ValueError("train.assistant_only_loss needs data.format: messages (plain text has no assistant turns)")
        if self.data.format == "text" and self.data.source == "demo":
            raise ValueError("data.source: demo is conversations; use data.format: messages")
        if self.finetune == "full" and self.model.load_in_4bit:
            raise ValueError("finetune: full cannot train a 4-bit model; use finetune: lora (QLoRA)")
        return self

    def resolved_output_dir(self) -> Path:
        return Path(self.output_dir.format(name=self.name))


class RecipeError(ValueError):
    """A recipe file that cannot be used; the message names the file and the key."""


def _format_errors(path: str, exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        key = ".".join(str(p) for p in error["loc"]) or "(top level)"
        message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
        lines.append(f"  {key}: {message}")
    return f"{path}: invalid recipe\n" + "\n".join(lines)


def parse_recipe(data: dict[str, Any], source: str = "<recipe>") -> Recipe:
    """Validate a recipe dict; raises RecipeError naming every bad key."""
    if not isinstance(data, dict):
        raise RecipeError(f"{source}: a recipe must be a YAML mapping, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_format_errors(source, exc)) from None


def load_recipe(path_or_name: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Load a recipe from a YAML path or the name of a bundled recipe (e.g. ``tiny-cpu``).

    Args:
        overrides: ``dotted.key=value`` strings (values parsed as YAML), applied before validation,
            e.g. ``["train.max_steps=10", "model.load_in_4bit=false"]``.
    """
    path = Path(path_or_name)
    if not path.is_file():
        bundled = Path(__file__).parent / f"{path_or_name}.yaml"
        if not bundled.is_file():
            names = ", ".join(sorted(p.stem for p in Path(__file__).parent.glob("*.yaml")))
            raise RecipeError(f"recipe {path_or_name!r} is neither a file nor a bundled recipe ({names})")
        path = bundled
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    for override in overrides or []:
        _apply_override(data, override, str(path))
    return parse_recipe(data, str(path))


def _apply_override(data: dict[str, Any], override: str, source: str) -> None:
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise RecipeError(f"{source}: override {override!r} must look like section.key=value")
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise RecipeError(f"{source}: override {override!r}: {part} is not a section")
    node[leaf] = yaml.safe_load(raw)


def bundled_recipes() -> list[str]:
    """Names of the recipes shipped with longpeft."""
    return sorted(p.stem for p in Path(__file__).parent.glob("*.yaml"))
