"""Per-GPU memory and wall-time estimate of a recipe, term by term (``longpeft plan RECIPE --gpus N``).

Memory: bytes per GPU of the base weights, what trains (with its gradient and AdamW state), the activations
(:func:`activation_terms`), DDP's gradient buckets or a sharded launch's gathered layers, and the runtime (CUDA
context, 10 % of the activations, the allocator's reserve). Time: the matmul FLOPs per token times each sample's
length, plus attention at its length squared, over the GPUs' peak bf16 FLOP/s times measured utilisations; in the
recipe's order each step lasts as long as its slowest GPU (:func:`.lengths.ordered_seconds`). Communication between
nodes: :mod:`.network`. ``docs/scale.md`` explains the terms; ``docs/measurements/README.md`` holds the constants
measured on an H100 and the runs they were fitted to.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..adapters import get_method
from ..base_config import model_location
from ..errors import ConfigError
from ..files import is_local
from ..launch import DEEPSPEED_LAUNCHES, SHARDED_LAUNCHES, check_launch, check_sequence_parallel, check_sharded
from ..launch.topology import gradient_accumulation
from ..units import format_duration
from .checkpointing import CheckpointSettings
from .lengths import SampleLengths, epoch_steps, format_histogram, length_histogram, ordered_seconds
from .network import inter_node_lines

GiB = 1024**3
# Dense bf16 peak TFLOP/s.
GPU_PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "a100": 312.0, "a800": 312.0, "l40s": 362.0}
# Fractions of that peak measured on an H100 (docs/measurements/README.md): the matmuls by base (4-bit or not),
# attention by kernel. The H200 is the same chip at the same peak and takes them too.
MEASURED_ON_H100 = {"matmuls": {True: 0.48, False: 0.46}, "attention": {"sdpa": 0.51, "flash_attention_2": 0.31}}
MEASURED_UTILISATION = {"h100": MEASURED_ON_H100, "h200": MEASURED_ON_H100}
UNMEASURED_UTILISATION = {True: 0.35, False: 0.45}  # other GPUs, both parts: 4-bit bases pay for dequantization
ALLOCATOR_RESERVE = 5 * GiB  # reserved beyond the allocated peak, fitted on an H100 (docs/measurements)
TRL_OFFLOAD_STASH = 5  # offloaded activations TRL keeps on the GPU until their copy ends (max_fwd_stash_size)
# train.offload_checkpoints: the last checkpointed layer's input (kept) and the one fetched ahead stay on the GPU
OFFLOADED_INPUTS_ON_GPU = 2
BUDGET_SHARE = 0.95  # of the GPU's memory, what the auto checkpointing choices plan for by default
# Shapes of common bases, so that planning needs no download; instruct/chat releases have their base's shape.
_LLAMA3_8B = dict(
    hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, tied=False
)
_LLAMA2_7B = {**_LLAMA3_8B, "kv_heads": 32, "intermediate": 11008, "vocab": 32000}
_MISTRAL_7B = {**_LLAMA3_8B, "vocab": 32000}
_QWEN2_7B = dict(
    hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064, tied=False
)
KNOWN_SHAPES = {
    "meta-llama/Meta-Llama-3-8B-Instruct": _LLAMA3_8B,
    "meta-llama/Meta-Llama-3-8B": _LLAMA3_8B,
    "meta-llama/Llama-2-7b-hf": _LLAMA2_7B,
    "mistralai/Mistral-7B-v0.1": _MISTRAL_7B,
    "Qwen/Qwen2-7B": _QWEN2_7B,
    "meta-llama/Llama-3.1-8B-Instruct": _LLAMA3_8B,
    "meta-llama/Llama-2-7b-chat-hf": _LLAMA2_7B,
    "mistralai/Mistral-7B-Instruct-v0.2": _MISTRAL_7B,
    "Qwen/Qwen2-7B-Instruct": _QWEN2_7B,
}
TILE_TOKENS, TILE_VOCAB = 4096, 32768
# DeepSpeed's default reduce_bucket_size (elements): ZeRO-3 allocates one contiguous gradient bucket of it per GPU
# (longpeft's launch configs leave it at the default; accelerate writes no "auto" for the Trainer to fill).
DEEPSPEED_REDUCE_BUCKET = 500_000_000
# The terms that grow with the tokens (what sequence parallelism splits; 10 % of them count as fragmentation).
ACTIVATION_TERMS = (
    "checkpointed layer inputs",
    "kept attention outputs",
    "layers not checkpointed",
    "one layer's recompute",
    "all layers' activations",
    "eager attention scores",
    "loss tiles",
)


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False

    @property
    def linear_params(self) -> int:
        """Parameters of the decoder layers' linear projections (what 4-bit quantizes)."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return self.layers * (attention + 3 * self.hidden * self.intermediate)

    @property
    def other_params(self) -> int:
        """Embedding, LM head (unless tied) and norms."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + (2 * self.layers + 1) * self.hidden

    def projection_shape(self, name: str) -> tuple[int, int]:
        """``(in, out)`` features of a projection by its usual name."""
        attention, kv, mlp = self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        shapes = {"q_proj": attention, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
        if name in shapes:
            return self.hidden, shapes[name]
        if name in ("o_proj", "down_proj"):
            return attention if name == "o_proj" else mlp, self.hidden
        raise ConfigError(f"lora.target_modules: {name!r} is not a projection the planner knows")


def shape_of(name_or_path: str) -> ModelShape:
    """A model's shape from a ``tiny:`` model, its config.json on this machine (a local or built-in model folder's,
    or a Hub model's already in the Hugging Face cache; never downloaded), or the table of known bases."""
    if name_or_path.startswith("tiny:"):
        from ..tiny import tiny_config

        return shape_from_config(tiny_config(name_or_path[5:]).to_dict())
    config_file = Path(model_location(name_or_path)) / "config.json"
    if not config_file.is_file() and not is_local(name_or_path):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name_or_path, "config.json")
        config_file = Path(cached) if isinstance(cached, str) else config_file
    if config_file.is_file():
        return shape_from_config(json.loads(config_file.read_text()))
    if name_or_path in KNOWN_SHAPES:
        return ModelShape(**KNOWN_SHAPES[name_or_path])
    raise ConfigError(
        f"model {name_or_path!r}: no local config.json and not a known base ({', '.join(KNOWN_SHAPES)}); "
        "point model.name_or_path at a folder with the model's config.json"
    )


def shape_from_config(config: dict[str, Any]) -> ModelShape:
    heads = config["num_attention_heads"]
    return ModelShape(
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", False)),
    )


@dataclass
class Plan:
    """The estimate: memory terms in bytes per GPU, time, and what to change when it does not fit."""

    gpus: int
    gpu_memory_gib: float
    terms: dict[str, int]
    tokens: int
    flops_per_token: float  # all of it, attention included
    attention_flops_per_token: float  # the attention kernels' share of flops_per_token
    hours: float
    assumptions: dict[str, Any] = field(default_factory=dict)
    method_levers: dict[str, str] = field(default_factory=dict)  # {"beacon weights": what to change, ...}
    length_histogram: list[dict[str, Any]] = field(default_factory=list)  # planned from the samples' own lengths

    @property
    def peak_bytes(self) -> int:
        return sum(self.terms.values())

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.gpu_memory_gib * GiB

    def levers(self) -> list[str]:
        """What would make the run fit (or faster), largest memory term first."""
        if self.fits:
            return []
        assumed, launch = self.assumptions, self.assumptions.get("launch")
        shard = sequence = None  # None: the recipe cannot use that lever (train --launch would refuse it)
        if launch in SHARDED_LAUNCHES:
            shard = f"more GPUs (--launch {launch} divides it by their number)"
        elif assumed.get("can_shard", True):
            shard = (
                "--launch fsdp2 or zero3 (weights, gradients and AdamW state sharded across the GPUs; plan it "
                f"with --launch fsdp2 --gpus {self.gpus})"
            )
        if launch == "ulysses":
            sequence = "more GPUs in the sequence-parallel group (each holds tokens / GPUs)"
        elif assumed.get("can_split_sequences", True):
            sequence = "sequence parallelism across GPUs (--launch ulysses)"
        offload = None
        if not (assumed.get("activation_offloading") or assumed.get("checkpointing", {}).get("offload")):
            offload = "train.offload_checkpoints: true (the layer inputs wait in CPU memory, fetched back ahead of "
            offload += "their layer)"
        retrain = "finetune: lora with " if assumed.get("finetune") in ("full", "method") else ""
        qlora = None if assumed.get("load_in_4bit") and not retrain else f"{retrain}model.load_in_4bit: true (QLoRA)"
        bf16_state = ", or lora.trainable_dtype: bfloat16 (halves it; AdamW then drops updates below bf16 precision)"
        advice = {
            "checkpointed layer inputs": _either(offload, sequence),
            "one layer's recompute": _either(
                "train.mlp_tile_tokens: 4096 (the MLP's intermediates one tile at a time)",
                "a shorter data.max_length",
                sequence,
            ),
            "kept attention outputs": "train.keep_attention: auto (keeps what fits) or fewer layers",
            "layers not checkpointed": "train.checkpoint_layers: auto (checkpoints what memory forces) or all",
            "trainable embedding": "lora.embeddings: token_indices (train only the rows you need), or an 8-bit "
            "optimizer (train.optim: adamw_bnb_8bit)" + ("" if launch in DEEPSPEED_LAUNCHES else bf16_state),
            "base weights": _either(shard, qlora),
            "optimizer state and gradients": _either(shard, "finetune: lora"),
            "DDP gradient buckets": "lora.embeddings: token_indices (the buckets hold the trainable gradients)"
            if assumed.get("finetune") == "lora"
            else shard,
            "gathered layers and LM head": "nothing to gain: the shards are gathered one layer at a time",
            "LoRA": "a smaller lora.r or fewer target modules",
            "loss tiles": "nothing to gain: the loss is already tiled",
            **self.method_levers,
        }
        ranked = sorted(self.terms, key=self.terms.get, reverse=True)
        return [f"{term}: {advice[term]}" for term in ranked if advice.get(term)][:3]

    def table(self) -> str:
        assumed, width = self.assumptions, max(map(len, self.terms))
        lines = [f"{'term':<{width}} {'GiB per GPU':>12}"]
        lines += [f"{term:<{width}} {value / GiB:>12.2f}" for term, value in self.terms.items()]
        verdict = "fits" if self.fits else "does NOT fit"
        launch, pinned = assumed["launch"], assumed.get("pinned_host_bytes")
        lines += [
            f"{'peak':<{width}} {self.peak_bytes / GiB:>12.2f}   ({verdict} in {self.gpu_memory_gib:g} GiB"
            f"{f', --launch {launch}' if launch else ''})",
            f"checkpointing: {assumed['checkpointing_summary']}"
            + (f" ({pinned / GiB:.1f} GiB of pinned host memory per GPU)" if pinned else ""),
        ]
        lines += format_histogram(self.length_histogram) if self.length_histogram else []
        # the time line ends with what it leaves out (and the hours in the recipe's order, which count it)
        ending = "; padding to each batch's longest sample not counted" * bool(assumed.get("padding_not_counted"))
        ending += "; every GPU equally loaded" * bool(assumed.get("unequal_load_not_counted"))
        if assumed.get("hours_in_order") is not None:
            ending += (
                f" (in the order the recipe trains them, {assumed['order']}, {assumed['order_waits']}: "
                f"{format_duration(assumed['hours_in_order'] * 3600)})"
            )
        utilisation = assumed["utilisation"]
        lines += [
            f"time: {assumed['time_basis']} = {self.tokens:,} tokens x {self.flops_per_token / 1e9:.1f} GFLOP/token "
            f"({self.attention_flops_per_token / 1e9:.1f} of them attention) on {self.gpus} GPUs at "
            f"{utilisation['matmuls']:.0%} (matmuls) and {utilisation['attention']:.0%} (attention, "
            f"{assumed['attention']}) of {assumed['peak_tflops']:g} TFLOP/s ({utilisation['source']}){ending} = "
            f"{format_duration(self.hours * 3600)}"
        ]
        lines += inter_node_lines(assumed.get("inter_node"), self.hours)
        lines += [f"lever: {lever}" for lever in self.levers()]
        return "\n".join(lines)


def _either(*options: str | None) -> str | None:
    """The usable options joined with ", or " (None when there is none)."""
    return ", or ".join(option for option in options if option) or None


def _allowed(check: Any, *args: Any) -> bool:
    """Whether ``check(*args)`` (a launch check) accepts, rather than raises."""
    try:
        check(*args)
    except ConfigError:
        return False
    return True


@dataclass(frozen=True)
class RunLayout:
    """How a launch lays a recipe's run out on the GPUs: what the terms read besides the model's shape."""

    gpus: int
    launch: str | None  # as ``longpeft train --launch``; None on one GPU
    shards: int  # GPUs that split weights, gradients and AdamW state
    sequence_shards: int  # GPUs that split each sequence
    data_parallel: int  # GPUs that train samples of their own
    deepspeed: bool  # a DeepSpeed launch
    accumulation: int  # gradient accumulation steps
    dtype_bytes: int  # per value in the compute dtype
    batch: int  # samples per GPU and step
    tokens_per_sample: int  # data.max_length: what the memory terms plan for
    activation_tokens: int  # tokens whose activations one GPU holds (its share of them under ulysses)

    @classmethod
    def of(cls, recipe: Any, gpus: int, launch: str | None) -> RunLayout:
        """``launch`` defaults to ``ddp`` on several GPUs; what ``train --launch`` refuses (or a global batch the
        GPUs do not divide) is refused here."""
        launch = launch or ("ddp" if gpus > 1 else None)
        if launch:
            check_launch(recipe, launch)
        sequence_shards = gpus if launch == "ulysses" else 1
        batch, tokens = recipe.train.per_device_batch_size, recipe.data.max_length
        return cls(
            gpus=gpus,
            launch=launch,
            shards=gpus if launch in SHARDED_LAUNCHES else 1,
            sequence_shards=sequence_shards,
            data_parallel=gpus // sequence_shards,
            deepspeed=launch in DEEPSPEED_LAUNCHES,
            accumulation=gradient_accumulation(recipe, gpus // sequence_shards),  # train refuses what does not divide
            dtype_bytes=4 if recipe.model.dtype == "float32" else 2,
            batch=batch,
            tokens_per_sample=tokens,
            activation_tokens=-(-batch * tokens // sequence_shards),
        )

    def with_state(self, weight_bytes: int) -> int:
        """Bytes per trained parameter: its weight, gradient and AdamW's two moments, all in the weight's dtype;
        under DeepSpeed the gradient in the compute dtype, and a float32 master copy and float32 moments whatever
        the weight's dtype (measured: tests/zero3_bytes_worker.py)."""
        return weight_bytes + self.dtype_bytes + 4 + 8 if self.deepspeed else 4 * weight_bytes


@dataclass
class TrainedWeights:
    """What trains, counted on one replica for the terms after the weights and for the time."""

    params: int = 0  # every trained parameter
    matmul_params: int = 0  # those in matmuls (their gradients cost FLOPs)
    lora_params: int = 0
    method_params: int = 0  # the methods' own weights, trained and frozen
    weight_bytes: int = 4  # per trained weight as stored: float32 unless lora.trainable_dtype says otherwise
    levers: dict[str, str] = field(default_factory=dict)  # the methods' levers, by term


def quantization_constants(recipe: Any) -> float:
    """Bytes per 4-bit weight of its quantization constants: one fp32 absmax per 64 weights, or with double
    quantization 8-bit plus one fp32 per 256 of those. Not parameters, so FSDP2 and ZeRO-3 do not shard them."""
    return 1 / 64 + 4 / (256 * 64) if recipe.model.bnb_4bit_use_double_quant else 4 / 64


def linear_weight_bytes(recipe: Any, dtype_bytes: int) -> float:
    """Bytes per parameter of the decoder layers' linear projections as stored: 4-bit's half a byte plus its
    quantization constants, else the compute dtype's."""
    return 0.5 + quantization_constants(recipe) if recipe.model.load_in_4bit else dtype_bytes


def lora_terms(recipe: Any, shape: ModelShape, run: RunLayout, trained: TrainedWeights) -> dict[str, int]:
    """The LoRA matrices of ``lora.target_modules`` and a trainable embedding (every row, or ``token_indices``'),
    each with its AdamW state; counts them into ``trained``."""
    trained.weight_bytes = 2 if recipe.lora.trainable_dtype == "bfloat16" else 4
    if run.deepspeed and recipe.model.load_in_4bit:  # DeepSpeed casts every weight of a model zero.Init did not build
        trained.weight_bytes = run.dtype_bytes
    per_param = run.with_state(trained.weight_bytes)
    lora = shape.layers * sum(recipe.lora.r * sum(shape.projection_shape(n)) for n in recipe.lora.target_modules)
    trained.params = trained.matmul_params = trained.lora_params = lora
    terms = {"LoRA": lora * per_param}
    rows = {"full": shape.vocab, "token_indices": len(recipe.lora.trainable_token_indices or [])}
    if recipe.lora.embeddings in rows:
        terms["trainable embedding"] = rows[recipe.lora.embeddings] * shape.hidden * per_param
        trained.params += rows[recipe.lora.embeddings] * shape.hidden
    return terms


def full_finetune_terms(shape: ModelShape, run: RunLayout, trained: TrainedWeights) -> dict[str, int]:
    """A full fine-tune's weights (float32; under DeepSpeed in the compute dtype beside a float32 master copy),
    replacing the base's, with their gradients and AdamW moments; counts them into ``trained``."""
    full = trained.params = shape.linear_params + shape.other_params
    weight_bytes = run.dtype_bytes if run.deepspeed else 4
    trained.matmul_params = shape.linear_params + shape.vocab * shape.hidden
    return {
        "base weights": full * weight_bytes,
        "optimizer state and gradients": full * (run.with_state(weight_bytes) - weight_bytes),
    }


def method_weight_terms(recipe: Any, shape: ModelShape, trained: TrainedWeights) -> dict[str, int]:
    """Each method's own weights (its ``planned_weights`` hook), which train in every mode: float32, with AdamW
    state on the trainable ones; counts them into ``trained``, with the method's lever."""
    terms = {}
    for name, config in recipe.method_configs().items():
        method = get_method(name)
        if method.keeps_weights:
            trainable, frozen = method.planned_weights(config, shape)
            terms[f"{name} weights"] = trainable * 16 + frozen * 4
            trained.method_params += trainable + frozen
            trained.params += trainable
            trained.matmul_params += trainable
            trained.levers[f"{name} weights"] = method.plan_lever
    return terms


def activation_memory_terms(
    recipe: Any, shape: ModelShape, run: RunLayout, checkpointing: CheckpointSettings
) -> dict[str, int]:
    """What grows with the tokens: the decoder layers' activations (:func:`activation_terms`), eager attention's
    scores and probabilities (one layer's, the recomputed one, and those of the layers not checkpointed; every
    layer's without checkpointing), and the fused loss's tiles with the final hidden states."""
    offloaded = recipe.train.activation_offloading and checkpointing.checkpointed > 0
    terms = activation_terms(
        shape, checkpointing, run.activation_tokens, run.dtype_bytes, recipe.train.mlp_tile_tokens, offloaded
    )
    if recipe.model.attn_implementation == "eager":
        layers_kept = 1 + shape.layers - checkpointing.checkpointed if checkpointing.checkpointed else shape.layers
        terms["eager attention scores"] = (
            layers_kept * run.batch * shape.heads * run.tokens_per_sample**2 * run.dtype_bytes * 2
        )
    terms["loss tiles"] = 3 * TILE_TOKENS * TILE_VOCAB * 4 + 2 * run.activation_tokens * shape.hidden * run.dtype_bytes
    return terms


def sharded_terms(
    recipe: Any, shape: ModelShape, run: RunLayout, trained: TrainedWeights, terms: dict[str, int]
) -> dict[str, int]:
    """``terms`` under a sharded launch: every term but the activations divided by the GPUs (a 4-bit base's
    quantization constants stay whole), then what is gathered whole while in use: two decoder layers, the LM head
    (TRL's fused loss gathers it itself, as stored: float32 when it trains) and the largest unsharded gradient; under
    DeepSpeed its contiguous reduce bucket, in the compute dtype."""
    whole = int(shape.linear_params * quantization_constants(recipe)) if recipe.model.load_in_4bit else 0
    sharded = {}
    for term, value in terms.items():
        kept = whole if term == "base weights" else 0
        sharded[term] = value if term in ACTIVATION_TERMS else kept + -(-(value - kept) // run.shards)
    dtype_bytes, full = run.dtype_bytes, recipe.finetune == "full"
    layer_bytes = (
        shape.linear_params // shape.layers * linear_weight_bytes(recipe, dtype_bytes)
        + (trained.lora_params + trained.method_params) // shape.layers * dtype_bytes
    )
    head_bytes = shape.vocab * shape.hidden * (4 if full and not run.deepspeed else dtype_bytes)
    trained_layer = (shape.linear_params if full else trained.lora_params) // shape.layers + (
        trained.method_params // shape.layers
    )
    trained_embedding = shape.vocab * shape.hidden if full or recipe.lora.embeddings == "full" else 0
    unsharded_gradients = max(trained_layer * dtype_bytes, trained_embedding * dtype_bytes, head_bytes if full else 0)
    sharded["gathered layers and LM head"] = int(2 * layer_bytes + head_bytes + unsharded_gradients)
    if run.deepspeed:
        sharded["DeepSpeed reduce bucket"] = DEEPSPEED_REDUCE_BUCKET * dtype_bytes
    return sharded


def matmul_flops_per_token(
    recipe: Any, shape: ModelShape, checkpointing: CheckpointSettings, trained: TrainedWeights
) -> float:
    """Matmul FLOPs per trained token: the forward (2 per parameter of the decoder layers and the LM head; the
    input embedding is a lookup), the checkpointed layers' forward again, the fused loss's recompute of the logits,
    the backward to the activations (twice the forward) and the trained weights' gradients. A tiled MLP in a layer
    that is not checkpointed runs its forward again in its backward; in a checkpointed one the recompute stops before
    the tiles (:mod:`.tiling`), so nothing is added."""
    layers = shape.linear_params + trained.lora_params  # the decoder layers' matmuls (what checkpointing recomputes)
    head = shape.vocab * shape.hidden
    recompute = 2 * layers * checkpointing.checkpointed / shape.layers
    tile_tokens = recipe.train.mlp_tile_tokens
    if tile_tokens and tile_tokens < recipe.data.max_length:
        recompute += 2 * 3 * shape.hidden * shape.intermediate * (shape.layers - checkpointing.checkpointed)
    return 2 * (layers + head) + recompute + 2 * head + 2 * (layers + head) + 2 * trained.matmul_params


def attention_flops_per_square(recipe: Any, shape: ModelShape, checkpointing: CheckpointSettings) -> float:
    """Attention FLOPs of a sample of ``n`` tokens over ``n**2``: per token and position it attends to, QK^T and AV
    forward, backward twice, and the recompute in the checkpointed layers that keep no attention output; eager
    attention computes the whole score matrix, SDPA's and flash-attn's kernels skip the causal mask's upper half."""
    passes = 3 + (checkpointing.checkpointed - checkpointing.keep_attention) / shape.layers
    per_position = 4 * shape.layers * shape.heads * shape.head_dim * passes
    return per_position * (1.0 if recipe.model.attn_implementation == "eager" else 0.5)


@dataclass(frozen=True)
class TrainingSchedule:
    """What the run trains: the data's rows and where their count comes from, the samples trained and the
    Trainer's optimizer steps (each epoch's last may take fewer samples), and the counted samples' lengths."""

    samples: int
    rows_from: str | None
    trained_samples: int
    optimizer_steps: int
    lengths: tuple[int, ...]  # () when not counted

    @classmethod
    def of(
        cls, recipe: Any, run: RunLayout, samples: int | None, sample_lengths: SampleLengths | None
    ) -> TrainingSchedule:
        """``samples`` rows, by default as many as were counted, else :func:`_samples`; every row as often over
        ``train.num_train_epochs``, or ``train.max_steps`` global batches."""
        lengths = sample_lengths.lengths if sample_lengths is not None else ()
        rows_from = "--samples" if samples is not None else None
        if samples is None:
            samples, rows_from = (len(lengths), "") if lengths else _samples(recipe)
        train = recipe.train
        if train.max_steps > 0:
            return cls(samples, rows_from, train.max_steps * train.global_batch_size, train.max_steps, lengths)
        per_epoch = epoch_steps(samples, run.batch, run.data_parallel, run.accumulation)
        steps = math.ceil(train.num_train_epochs * per_epoch)
        return cls(samples, rows_from, round(samples * train.num_train_epochs), steps, lengths)


def estimate(
    recipe: Any,
    gpus: int = 8,
    gpu_memory_gib: float = 80.0,
    gpu: str = "h100",
    mfu: float | None = None,
    samples: int | None = None,
    shape: ModelShape | None = None,
    launch: str | None = None,
    checkpointing: CheckpointSettings | None = None,
    sample_lengths: SampleLengths | None = None,
) -> Plan:
    """Estimate per-GPU peak memory and wall time of ``recipe`` (a validated Recipe) on ``gpus`` GPUs.

    Args:
        samples: rows of the training data (default: as many as ``sample_lengths`` has, else :func:`_samples`);
            unused when ``train.max_steps`` is set.
        sample_lengths: the samples' own token counts (:func:`longpeft.recipes.plan_data.count_sample_lengths`),
            which the time sums over; without them every sample is ``data.max_length`` tokens long, and the time
            line says so. The memory terms plan for ``data.max_length`` either way.
        launch: as ``longpeft train --launch`` (default ``ddp`` on several GPUs); what train refuses is refused.
        checkpointing: what each layer keeps (default: :func:`resolve_checkpointing` of the recipe's settings).
    """
    if gpu not in GPU_PEAK_TFLOPS:
        raise ConfigError(f"--gpu {gpu!r}: choose one of {', '.join(GPU_PEAK_TFLOPS)}")
    run = RunLayout.of(recipe, gpus, launch)
    shape = shape or shape_of(recipe.model.name_or_path)
    checkpointing = checkpointing or resolve_checkpointing(recipe, shape, gpus, gpu_memory_gib, gpu, run.launch)
    terms, trained = memory_terms(recipe, shape, run, checkpointing)
    schedule = TrainingSchedule.of(recipe, run, samples, sample_lengths)
    utilisation = _utilisation(gpu, recipe.model.load_in_4bit, recipe.model.attn_implementation, mfu)
    matmul_flops = matmul_flops_per_token(recipe, shape, checkpointing, trained)
    attention_per_square = attention_flops_per_square(recipe, shape, checkpointing)
    tokens, attention_flops, seconds, histogram, order = planned_time(
        recipe, run, schedule, matmul_flops, attention_per_square, utilisation, gpu
    )
    offloaded_inputs = max(checkpointing.checkpointed - 1, 0)  # all but the last wait in pinned host memory
    return Plan(
        gpus=gpus,
        gpu_memory_gib=gpu_memory_gib,
        terms=terms,
        tokens=tokens,
        flops_per_token=matmul_flops + attention_flops,
        attention_flops_per_token=attention_flops,
        hours=seconds / 3600,
        method_levers=trained.levers,
        length_histogram=histogram,
        assumptions={
            "gpu": gpu,
            "peak_tflops": GPU_PEAK_TFLOPS[gpu],
            "utilisation": utilisation,
            "attention": recipe.model.attn_implementation,
            "samples": schedule.samples,
            "tokens_per_sample": run.tokens_per_sample,
            "per_device_batch": run.batch,
            "trainable_params": trained.params,
            # as the gradients are reduced: sharded launches reduce (and DeepSpeed keeps) them in the compute dtype
            "gradient_bytes_per_param": run.dtype_bytes if run.launch in SHARDED_LAUNCHES else trained.weight_bytes,
            "trained_samples": schedule.trained_samples,
            "optimizer_steps": schedule.optimizer_steps,
            "time_basis": _time_basis(recipe, schedule, sample_lengths),
            **order,  # what the time leaves out when the samples' lengths differ, and the time in the recipe's order
            "trainable_dtype": f"{'float32' if trained.weight_bytes == 4 else 'bfloat16'} "
            f"({run.with_state(trained.weight_bytes)} bytes/param with AdamW)",
            "finetune": recipe.finetune,
            "load_in_4bit": recipe.model.load_in_4bit,
            "activation_offloading": recipe.train.activation_offloading and checkpointing.checkpointed > 0,
            "checkpointing": asdict(checkpointing),
            "pinned_host_bytes": offloaded_inputs * run.activation_tokens * shape.hidden * run.dtype_bytes
            if checkpointing.offload
            else 0,
            "checkpointing_summary": checkpointing.describe(shape.layers),
            "launch": run.launch,
            "sequence_parallel": run.sequence_shards,
            # the levers the recipe can use (train --launch would refuse the others)
            "can_shard": _allowed(check_sharded, recipe, "sharding"),
            "can_split_sequences": _allowed(check_sequence_parallel, recipe),
        },
    )


def memory_terms(
    recipe: Any, shape: ModelShape, run: RunLayout, checkpointing: CheckpointSettings
) -> tuple[dict[str, int], TrainedWeights]:
    """Per-GPU peak memory by term (bytes, largest contributors by name) and the weights that train."""
    base_bytes = (
        shape.linear_params * linear_weight_bytes(recipe, run.dtype_bytes) + shape.other_params * run.dtype_bytes
    )
    terms, trained = {"base weights": int(base_bytes)}, TrainedWeights()
    if recipe.finetune == "lora":
        terms.update(lora_terms(recipe, shape, run, trained))
    elif recipe.finetune == "full":
        terms.update(full_finetune_terms(shape, run, trained))
    terms.update(method_weight_terms(recipe, shape, trained))
    terms.update(activation_memory_terms(recipe, shape, run, checkpointing))
    if run.shards > 1:
        terms = sharded_terms(recipe, shape, run, trained, terms)
    elif run.gpus > 1:
        terms["DDP gradient buckets"] = trained.params * trained.weight_bytes
    activations = sum(terms.get(term, 0) for term in ACTIVATION_TERMS)
    terms["runtime (CUDA context, fragmentation)"] = GiB + activations // 10 + ALLOCATOR_RESERVE
    return terms, trained


def planned_time(
    recipe: Any,
    run: RunLayout,
    schedule: TrainingSchedule,
    matmul_flops: float,
    attention_per_square: float,
    utilisation: dict[str, Any],
    gpu: str,
) -> tuple[int, float, float, list[dict[str, Any]], dict[str, Any]]:
    """The FLOPs of every trained sample at its own length (the counted lengths, cycled through with a partial pass at
    their mean; else ``data.max_length`` each) over the GPUs' peak FLOP/s times ``utilisation``: ``(tokens, attention
    FLOPs per token, seconds, the lengths' histogram, the plan's assumptions on the order of the samples)``."""
    peak = GPU_PEAK_TFLOPS[gpu] * 1e12
    lengths = schedule.lengths or (run.tokens_per_sample,)
    planned_tokens = schedule.trained_samples * sum(lengths) / len(lengths)
    attention_total = attention_per_square * (schedule.trained_samples * sum(n * n for n in lengths) / len(lengths))
    attention_flops = attention_total / planned_tokens
    seconds = (planned_tokens * matmul_flops / utilisation["matmuls"] + attention_total / utilisation["attention"]) / (
        run.gpus * peak
    )

    def sample_seconds(n):  # one sample of n tokens on its GPU (its sequence-parallel group's share)
        return (
            n * matmul_flops / utilisation["matmuls"] + attention_per_square * n * n / utilisation["attention"]
        ) / (run.sequence_shards * peak)

    # the seconds in the order the recipe trains when the samples' lengths differ and a step holds several
    in_order = None
    if len(set(lengths)) > 1 and (run.data_parallel > 1 or run.batch > 1):
        batching = (schedule.optimizer_steps, run.batch, run.data_parallel, run.accumulation)
        in_order = ordered_seconds(
            lengths, sample_seconds, *batching, seed=recipe.train.seed, grouped=recipe.train.group_by_length
        )
    histogram = (
        length_histogram(lengths, run.tokens_per_sample, lambda n: n * matmul_flops + attention_per_square * n * n)
        if schedule.lengths
        else []
    )
    varied = len(set(schedule.lengths)) > 1
    padding, unequal_load = varied and run.batch > 1, varied and run.data_parallel > 1
    waits = ["each step waits for its slowest GPU"] * unequal_load
    waits += ["each batch is padded to its longest sample"] * padding
    return (
        round(planned_tokens),
        attention_flops,
        seconds,
        histogram,
        {
            "padding_not_counted": padding,
            "unequal_load_not_counted": unequal_load,
            "order": "grouped by length (train.group_by_length)"
            if recipe.train.group_by_length
            else "random (the Trainer's default; train.group_by_length: true groups them)",
            "order_waits": " and ".join(waits),
            "hours_in_order": None if in_order is None else in_order / 3600,
        },
    )


def activation_terms(
    shape: ModelShape,
    checkpointing: CheckpointSettings,
    tokens: int,
    dtype_bytes: int,
    mlp_tile_tokens: int | None = None,
    trl_offloading: bool = False,
) -> dict[str, int]:
    """The memory terms of the decoder layers' activations, in bytes, for ``tokens`` tokens on one GPU.

    One layer's activations per token: the attention projections (q, k, v, the attention output, o's input:
    ``3 hidden + 2 kv``), the norms' inputs (``2 hidden``) and the MLP (gate, up, the product and down's input:
    ``4 intermediate``; tiled, its input ``hidden`` plus one tile's ``4 intermediate`` for ``mlp_tile_tokens``
    tokens). Checkpointed layers keep their input (``hidden``: all of them, or with offloaded inputs the last one
    and the one fetched ahead; with TRL's activation offloading seven), kept attention outputs
    (``heads x head_dim`` in the compute dtype and a float32 log-sum-exp per head), and one layer's activations
    exist again during its recompute; layers not checkpointed keep all of theirs.
    """
    kv = shape.kv_heads * shape.head_dim
    mlp = tokens * 4 * shape.intermediate * dtype_bytes
    if mlp_tile_tokens and mlp_tile_tokens < tokens:
        mlp = tokens * shape.hidden * dtype_bytes + mlp_tile_tokens * 4 * shape.intermediate * dtype_bytes
    layer = tokens * (5 * shape.hidden + 2 * kv) * dtype_bytes + mlp
    checkpointed, layers = checkpointing.checkpointed, shape.layers
    if checkpointed == 0:
        return {"all layers' activations": layers * layer}
    if trl_offloading:  # in use, being fetched, and TRL's stash stay on the GPU
        inputs_on_gpu = 2 + TRL_OFFLOAD_STASH
    else:
        inputs_on_gpu = min(checkpointed, OFFLOADED_INPUTS_ON_GPU) if checkpointing.offload else checkpointed
    terms = {"checkpointed layer inputs": inputs_on_gpu * tokens * shape.hidden * dtype_bytes}
    if checkpointing.keep_attention:
        per_token = shape.heads * shape.head_dim * dtype_bytes + shape.heads * 4
        terms["kept attention outputs"] = checkpointing.keep_attention * tokens * per_token
    if checkpointed < layers:
        terms["layers not checkpointed"] = (layers - checkpointed) * layer
    terms["one layer's recompute"] = layer
    return terms


def resolve_checkpointing(
    recipe: Any,
    shape: ModelShape,
    gpus: int = 1,
    gpu_memory_gib: float = 80.0,
    gpu: str = "h100",
    launch: str | None = None,
) -> CheckpointSettings:
    """The recipe's ``train.checkpoint_layers`` / ``keep_attention`` / ``offload_checkpoints`` on a model of
    ``shape``, with ``auto`` chosen by :func:`choose_checkpointing` within ``train.memory_budget_gib`` (default:
    95 % of ``gpu_memory_gib``)."""
    train = recipe.train
    if not train.gradient_checkpointing:
        return CheckpointSettings(0)
    layers = shape.layers  # the recipe's counts were checked against them (recipes.validate.check_layer_counts)
    checkpointed = train.checkpoint_layers if isinstance(train.checkpoint_layers, int) else layers
    keep = train.keep_attention
    kept = {"none": 0, "auto": 0, "all": checkpointed}[keep] if isinstance(keep, str) else min(keep, checkpointed)
    settings = CheckpointSettings(checkpointed, kept, train.offload_checkpoints)
    vary_layers, vary_attention = train.checkpoint_layers == "auto", keep == "auto"
    if not (vary_layers or vary_attention):
        return settings
    budget = (train.memory_budget_gib or BUDGET_SHARE * gpu_memory_gib) * GiB

    def plan_of(option: CheckpointSettings) -> Plan:
        return estimate(recipe, gpus, gpu_memory_gib, gpu, samples=1, shape=shape, launch=launch, checkpointing=option)

    return choose_checkpointing(plan_of, settings, budget, vary_layers, vary_attention)


def choose_checkpointing(
    plan_of: Callable[[CheckpointSettings], Plan],
    start: CheckpointSettings,
    budget_bytes: float,
    vary_layers: bool,
    vary_attention: bool,
) -> CheckpointSettings:
    """Keep what memory allows, starting from ``start``: one step at a time, take the change that saves the most
    time per byte of peak memory among keeping one more layer's attention outputs (``vary_attention``) and
    checkpointing one layer fewer (``vary_layers``), while the planned peak (``plan_of(settings).peak_bytes``)
    stays within ``budget_bytes``."""

    def seconds_per_token(plan: Plan) -> float:
        return plan.hours * 3600 / max(plan.tokens, 1)

    current, plan = start, plan_of(start)
    while True:
        options = []
        if vary_attention and current.keep_attention < current.checkpointed:
            options.append(replace(current, keep_attention=current.keep_attention + 1))
        if vary_layers and current.checkpointed > 0:
            fewer = current.checkpointed - 1
            options.append(replace(current, checkpointed=fewer, keep_attention=min(current.keep_attention, fewer)))
        best = None
        for option in options:
            candidate = plan_of(option)
            saved = seconds_per_token(plan) - seconds_per_token(candidate)
            if candidate.peak_bytes > budget_bytes or saved <= 0:
                continue
            score = saved / max(candidate.peak_bytes - plan.peak_bytes, 1)
            if best is None or score > best[0]:
                best = (score, option, candidate)
        if best is None:
            return current
        _, current, plan = best


def plan_at_length(
    recipe: Any,
    tokens: int,
    gpus: int = 1,
    gpu_memory_gib: float = 80.0,
    gpu: str = "h100",
    shape: ModelShape | None = None,
    launch: str | None = None,
) -> Plan:
    """The plan of one step on samples of ``tokens`` tokens (``data.max_length``), with the recipe's other
    settings."""
    data = recipe.data.model_copy(update={"max_length": tokens})
    return estimate(
        recipe.model_copy(update={"data": data}), gpus, gpu_memory_gib, gpu, samples=1, shape=shape, launch=launch
    )


def longest_fitting(
    recipe: Any,
    gpus: int = 1,
    gpu_memory_gib: float = 80.0,
    gpu: str = "h100",
    shape: ModelShape | None = None,
    launch: str | None = None,
    step: int = 1024,
    limit: int = 1 << 24,
) -> tuple[int, Plan]:
    """The longest sample (a multiple of ``step`` tokens, up to ``limit``) whose planned peak fits in
    ``gpu_memory_gib``, with the recipe's settings (``auto`` choices re-made at each length), and its plan; ``(0,
    plan at step tokens)`` when not even ``step`` tokens fit. Memory only: the positions of the model and the
    recipe's lengths bound a sample too (``longpeft.recipes.plan_data``)."""
    shape = shape or shape_of(recipe.model.name_or_path)

    def plan_at(tokens: int) -> Plan:
        return plan_at_length(recipe, tokens, gpus, gpu_memory_gib, gpu, shape, launch)

    low, high = 0, limit // step  # in steps: low fits (or is 0), high + 1 does not
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if plan_at(middle * step).fits else (low, middle - 1)
    return low * step, plan_at(max(low, 1) * step)


def _utilisation(gpu: str, four_bit: bool, attention: str, mfu: float | None) -> dict[str, float | str]:
    """Fractions of the peak FLOP/s: ``{"matmuls", "attention", "source"}``. ``mfu`` (``--mfu``) sets both; else
    the figures measured on this GPU (eager attention counts as matmuls), else the unmeasured defaults."""
    if mfu is not None:
        return {"matmuls": mfu, "attention": mfu, "source": "--mfu"}
    measured = MEASURED_UTILISATION.get(gpu)
    if measured is None:
        default = UNMEASURED_UTILISATION[four_bit]
        return {"matmuls": default, "attention": default, "source": f"assumed: not measured on {gpu}"}
    matmuls = measured["matmuls"][four_bit]
    attention_share = measured["attention"].get(attention, matmuls)
    return {"matmuls": matmuls, "attention": attention_share, "source": "measured on an H100"}


def _samples(recipe: Any) -> tuple[int, str]:
    """Rows of the training data and where that number comes from: a local JSONL file's rows, the demo set's
    ``n_conversations``, else ``data.max_samples`` or an assumed 1000 (pass ``--samples`` for the real count); at
    most ``data.max_samples`` (the runner reads no more)."""
    path, cap = Path(recipe.data.source), recipe.data.max_samples
    if path.is_file() and path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as handle:
            rows, rows_from = sum(1 for line in handle if line.strip()), f"the rows of {path}"
    elif recipe.data.source == "demo":
        from ..synth_data.demo import DEMO_CONVERSATIONS

        rows, rows_from = recipe.data.demo.n_conversations or DEMO_CONVERSATIONS, "the demo set's size"
    else:
        return (cap, "data.max_samples") if cap else (1000, "assumed: pass --samples N")
    return (min(rows, cap), f"{rows_from}, at most data.max_samples") if cap else (rows, rows_from)


def _time_basis(recipe: Any, schedule: TrainingSchedule, lengths: SampleLengths | None) -> str:
    """What the time is planned from, for its line: how many samples and why, and their lengths' source."""
    trained, rows, train = schedule.trained_samples, schedule.samples, recipe.train
    if train.max_steps > 0:
        how = f"train.max_steps={train.max_steps} x global batch {train.global_batch_size}"
    else:
        epochs = train.num_train_epochs
        how = f"{epochs:g} epoch{'' if epochs == 1 else 's'} of {rows:,} rows"
        how += f" ({schedule.rows_from})" if schedule.rows_from else ""
    if lengths is not None and lengths.lengths:
        counted, cycling = len(lengths.lengths), ""
        if rows != counted:
            cycling = f"; each of the {rows:,} rows planned at the {counted:,} counted samples' average"
        elif trained % counted:
            cycling = "; cycling through them, the partial pass at their average"
        return f"{trained:,} samples ({how}) at their own lengths ({lengths.describe()}{cycling})"
    why = lengths.unknown if lengths is not None else "no sample lengths given"
    return f"{trained:,} samples ({how}), each assumed {recipe.data.max_length:,} tokens long (data.max_length; {why})"
