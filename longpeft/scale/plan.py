"""Per-GPU memory and wall-time estimate of a recipe, term by term (``longpeft plan RECIPE --gpus N``).

Memory terms (bytes per GPU; with ``--launch ddp``, the default on several GPUs, every GPU holds a whole replica
and trains its own samples; sharded launches below):

- base weights: 4-bit NF4 linear layers at 0.5 byte/param plus the quantization constants (one fp32
  absmax per 64 weights, or with double quantization one 8-bit absmax per 64 and one fp32 per 256 x 64),
  everything else (embedding, LM head, norms) in the compute dtype; or the whole model in the compute dtype;
- LoRA: weights, gradients and AdamW's two moments in ``lora.trainable_dtype`` (float32 by default: 16 bytes/param;
  bfloat16: 8); ``finetune: full``: every weight trains in float32 (4 bytes of weights, 12 of gradients and AdamW
  state per parameter);
- trainable embedding (``lora.embeddings: full``): a trainable copy of the input embedding, the same bytes/param;
- a method's own weights (Activation Beacon's projections, in every finetune mode): float32, 16 bytes per
  trainable parameter and 4 per frozen one, counted by the method's ``planned_parameters`` registry hook;
- checkpointed layer inputs: with per-layer (non-reentrant) activation checkpointing each decoder layer keeps
  only its input hidden states, ``layers x batch x tokens x hidden`` in the compute dtype; with
  ``train.activation_offloading`` they wait in CPU memory and seven layers' worth stay on the GPU: the one in use,
  the one being fetched back, and the last five offloaded, which TRL keeps alive until their copy ends
  (``OffloadActivations(max_fwd_stash_size=5)``; measured at 131,072 tokens on an H100: 44.2 GiB allocated, 43.6
  planned without the runtime term);
- one layer's recompute: during its backward one layer's activations exist again: per token the attention
  projections (q, k, v, the attention output, o's input: ``3 hidden + 2 kv``), the MLP (gate, up, the
  product and down's input: ``4 intermediate``), and the norms' inputs (``2 hidden``), in the compute
  dtype; eager attention adds the ``heads x tokens x tokens`` scores and probabilities (of every layer without
  checkpointing);
- loss tiles: TRL's fused LM head scores 4096 tokens x 32768 vocabulary at a time in fp32 (tile, softmax
  and its gradient: 3 tiles), plus the final hidden states and their gradient;
- DDP gradient buckets: one more copy of the trainable gradients (in their dtype);
- runtime: the CUDA context and kernels' workspace (1 GiB), plus what torch's caching allocator reserves beyond
  the allocated peak: 10 % of the activations and 5 GiB. On an H100 the reserved peak exceeded the allocated one by
  5.3 to 9.0 GiB in all eight measured runs (32K to 128K tokens), nearly independent of the length; the 5 GiB is
  fitted to them, so that the planned peak is within -1 % to +8 % of the reserved one there.

Sharded launches (``launch`` ``fsdp2``, ``zero3``, or ``ulysses``, which runs ZeRO-3): the weights, gradients and
AdamW state terms are divided by the GPUs, and the DDP buckets give way to the gathered units: FSDP2 all-gathers one
decoder layer while the next is prefetched, in the compute dtype (4-bit weights gather as stored); TRL's fused loss
gathers the LM head itself (``DTensor.full_tensor``) in its stored dtype, float32 when it trains; the gradients of
one unit exist unsharded before their reduce-scatter (compute dtype; the LM head's in float32). ZeRO-3 bounds its
live parameters by its own buckets; the same term stands for them. A 4-bit base's quantization constants are no
parameters and stay whole on every GPU. DeepSpeed (``zero3``, ``ulysses``) keeps, per trained parameter, its weight
as stored (LoRA and the embedding copy in ``lora.trainable_dtype``; a full fine-tune's weights in the compute dtype,
as ``zero.Init`` built them; over a 4-bit base, which ``zero.Init`` does not build, DeepSpeed casts every weight to
the compute dtype), its gradient in the compute dtype, a separate float32 master copy and float32 AdamW moments,
whatever ``lora.trainable_dtype`` says: 18 bytes for float32 LoRA under bf16, 16 for QLoRA and for a bf16 full
fine-tune, 20 in float32 (measured with 2 CPU processes: ``tests/zero3_bytes_worker.py``; its code would reuse
float32 weights as the master copy, but compares a ``torch.device`` with a string there, which is never equal); plus
one contiguous reduce bucket of 5e8 elements in the compute dtype (1 GB in bf16) per GPU. ``ulysses`` also splits
every sequence across the GPUs (sequence parallel size = GPUs), so every activation term holds ``tokens / GPUs`` per
GPU. Communication time is not modelled (between nodes, ``plan --nodes``: :mod:`.network`).

Time: FLOPs per token = ``2 M`` for the forward of the ``M`` matmul parameters (decoder layers with LoRA, and the
LM head; the input embedding is a lookup), again for the checkpointed recompute (the layers) and for the fused
loss's recompute of the logits (the head), ``2 M`` for the backward to the activations, and ``2`` per trained
matmul parameter for the weights' gradients (LoRA: a small share; a trained embedding is a lookup's gradient);
attention adds ``4 x layers x context x heads x head_dim`` per token (forward QK^T and AV; context: half the
sample, as causal kernels skip the masked half, or all of it with eager attention), times 4 (forward, recompute,
backward twice). Tokens: ``train.max_steps x global batch`` samples when max_steps is set,
else the data's rows x ``num_train_epochs``, each of ``data.max_length`` tokens. Divided by the GPUs' peak bf16
FLOP/s times a utilisation, one for the matmuls and one for the attention kernel (``--mfu`` sets both).

Utilisations measured on one H100 80GB (``scripts/gpu_check.py``, 2026-11-24: torch 2.11 + CUDA 13, flash-attn
2.8.3, the 80K QLoRA recipe at 32,765, 49,152 and 81,920 tokens, one sample per step; ``docs/measurements/``):
``tokens x (matmul FLOPs / 0.48 + attention FLOPs / u) / peak`` fits the six step times within 1 %, with u = 0.51
for SDPA (cuDNN's Hopper kernels) and 0.31 for flash-attn 2 (its Ampere kernels; the FlashAttention-3 paper reports
35 % of an H100's peak for them), and the same 0.48 for the matmuls under both kernels. A bf16 base's matmuls: 0.46
(one run, 32,765 tokens with SDPA; at these lengths dequantization is amortised over the tokens). With activation
offloading at 131,072 tokens the step took 2 % longer than planned (the copies overlap the compute). H200 takes
H100's figures (the same chip and peak). Other GPUs are not measured: both utilisations default to 0.35 for 4-bit
bases, 0.45 otherwise, as before these measurements.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..adapters import get_method
from ..builtin_models import model_location
from ..launch import DEEPSPEED_LAUNCHES, SHARDED_LAUNCHES, check_launch, check_sequence_parallel, check_sharded
from .network import inter_node_lines

GiB = 1024**3
# Dense bf16 peak TFLOP/s.
GPU_PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0, "a100": 312.0, "a800": 312.0, "l40s": 362.0}
# Fractions of that peak measured on an H100 (module docstring): the matmuls by base (4-bit or not), attention by
# kernel. The H200 is the same chip at the same peak and takes them too.
MEASURED_ON_H100 = {"matmuls": {True: 0.48, False: 0.46}, "attention": {"sdpa": 0.51, "flash_attention_2": 0.31}}
MEASURED_UTILISATION = {"h100": MEASURED_ON_H100, "h200": MEASURED_ON_H100}
UNMEASURED_UTILISATION = {True: 0.35, False: 0.45}  # other GPUs, both parts: 4-bit bases pay for dequantization
ALLOCATOR_RESERVE = 5 * GiB  # reserved beyond the allocated peak, fitted on an H100 (module docstring)
TRL_OFFLOAD_STASH = 5  # offloaded activations TRL keeps on the GPU until their copy ends (max_fwd_stash_size)
# Shapes of common bases, so that planning needs no download.
KNOWN_SHAPES = {
    "meta-llama/Meta-Llama-3-8B-Instruct": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, tied=False),
    "meta-llama/Meta-Llama-3-8B": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, tied=False),
    "meta-llama/Llama-2-7b-hf": dict(hidden=4096, layers=32, heads=32, kv_heads=32, head_dim=128, intermediate=11008, vocab=32000, tied=False),
    "mistralai/Mistral-7B-v0.1": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=32000, tied=False),
    "Qwen/Qwen2-7B": dict(hidden=3584, layers=28, heads=28, kv_heads=4, head_dim=128, intermediate=18944, vocab=152064, tied=False),
}
# Instruct/chat releases have their base's shape.
KNOWN_SHAPES.update({
    "meta-llama/Llama-3.1-8B-Instruct": KNOWN_SHAPES["meta-llama/Meta-Llama-3-8B-Instruct"],
    "meta-llama/Llama-2-7b-chat-hf": KNOWN_SHAPES["meta-llama/Llama-2-7b-hf"],
    "mistralai/Mistral-7B-Instruct-v0.2": KNOWN_SHAPES["mistralai/Mistral-7B-v0.1"],
    "Qwen/Qwen2-7B-Instruct": KNOWN_SHAPES["Qwen/Qwen2-7B"],
})
TILE_TOKENS, TILE_VOCAB = 4096, 32768
# DeepSpeed's default reduce_bucket_size (elements): ZeRO-3 allocates one contiguous gradient bucket of it per GPU
# (longpeft's launch configs leave it at the default; accelerate writes no "auto" for the Trainer to fill).
DEEPSPEED_REDUCE_BUCKET = 500_000_000
# The terms that grow with the tokens (what sequence parallelism splits; 10 % of them count as fragmentation).
ACTIVATION_TERMS = ("checkpointed layer inputs", "one layer's recompute", "all layers' activations",
                    "eager attention scores", "loss tiles")


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
        attention_out = {"q_proj": self.heads, "k_proj": self.kv_heads, "v_proj": self.kv_heads}
        if name in attention_out:
            return self.hidden, attention_out[name] * self.head_dim
        if name == "o_proj":
            return self.heads * self.head_dim, self.hidden
        if name in ("gate_proj", "up_proj"):
            return self.hidden, self.intermediate
        if name == "down_proj":
            return self.intermediate, self.hidden
        raise ValueError(f"lora.target_modules: {name!r} is not a projection the planner knows")


def local_config_file(name_or_path: str) -> Path | None:
    """The base's ``config.json`` on this machine, never downloaded: a local (or built-in) model folder's, or a Hub
    model's already in the Hugging Face cache; None when there is none."""
    config_file = Path(model_location(name_or_path)) / "config.json"
    if config_file.is_file():
        return config_file
    from ..loading import is_local

    if is_local(name_or_path):
        return None
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(name_or_path, "config.json")
    return Path(cached) if isinstance(cached, str) else None


def shape_of(name_or_path: str) -> ModelShape:
    """A model's shape from a ``tiny:`` model, its config.json on this machine (:func:`local_config_file`), or the
    table of known bases."""
    if name_or_path.startswith("tiny:"):
        from ..tiny import tiny_config

        return _from_config(tiny_config(name_or_path[5:]).to_dict())
    config_file = local_config_file(name_or_path)
    if config_file is not None:
        return _from_config(json.loads(config_file.read_text()))
    if name_or_path in KNOWN_SHAPES:
        return ModelShape(**KNOWN_SHAPES[name_or_path])
    raise ValueError(
        f"model {name_or_path!r}: no local config.json and not a known base ({', '.join(KNOWN_SHAPES)}); "
        "point model.name_or_path at a folder with the model's config.json"
    )


def _from_config(config: dict[str, Any]) -> ModelShape:
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

    @property
    def peak_bytes(self) -> int:
        return sum(self.terms.values())

    @property
    def sharded(self) -> bool:
        return self.assumptions.get("launch") in SHARDED_LAUNCHES

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.gpu_memory_gib * GiB

    def levers(self) -> list[str]:
        """What would make the run fit (or faster), largest memory term first."""
        if self.fits:
            return []
        ranked = sorted(self.terms, key=self.terms.get, reverse=True)
        finetune, launch = self.assumptions.get("finetune"), self.assumptions.get("launch")
        shard = sequence = None  # None: the recipe cannot use that lever (train --launch would refuse it)
        if self.sharded:
            shard = f"more GPUs (--launch {launch} divides it by their number)"
        elif self.assumptions.get("can_shard", True):
            shard = (f"--launch fsdp2 or zero3 (weights, gradients and AdamW state sharded across the GPUs; plan it with "
                     f"--launch fsdp2 --gpus {self.gpus})")
        if launch == "ulysses":
            sequence = "more GPUs in the sequence-parallel group (each holds tokens / GPUs)"
        elif self.assumptions.get("can_split_sequences", True):
            sequence = "sequence parallelism across GPUs (--launch ulysses)"
        offload = None if self.assumptions.get("activation_offloading") else \
            "train.activation_offloading: true (TRL moves checkpointed inputs to CPU memory)"
        qlora = "finetune: lora with model.load_in_4bit: true (QLoRA)" if finetune in ("full", "method") else (
            None if self.assumptions.get("load_in_4bit") else "model.load_in_4bit: true (QLoRA)")
        advice = {
            "checkpointed layer inputs": _either(offload, sequence),
            "one layer's recompute": _either("a shorter data.max_length", sequence),
            "trainable embedding": "lora.embeddings: token_indices (train only the rows you need), or an 8-bit optimizer "
                                   "(train.optim: adamw_bnb_8bit)" + ("" if launch in DEEPSPEED_LAUNCHES else
                                   ", or lora.trainable_dtype: bfloat16 (halves it; AdamW then drops updates below bf16 "
                                   "precision)"),
            "base weights": _either(shard, qlora),
            "optimizer state and gradients": _either(shard, "finetune: lora"),
            "DDP gradient buckets": "lora.embeddings: token_indices (the buckets hold the trainable gradients)"
            if finetune == "lora" else shard,
            "gathered layers and LM head": "nothing to gain: the shards are gathered one layer at a time",
            "LoRA": "a smaller lora.r or fewer target modules",
            "loss tiles": "nothing to gain: the loss is already tiled",
            **self.method_levers,
        }
        advice = {term: text for term, text in advice.items() if text}
        return [f"{term}: {advice[term]}" for term in ranked if term in advice][:3]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(peak_bytes=self.peak_bytes, fits=self.fits, levers=self.levers())
        return data

    def table(self) -> str:
        width = max(map(len, self.terms))
        lines = [f"{'term':<{width}} {'GiB per GPU':>12}"]
        lines += [f"{term:<{width}} {value / GiB:>12.2f}" for term, value in self.terms.items()]
        verdict = "fits" if self.fits else "does NOT fit"
        launch = self.assumptions["launch"]
        lines += [f"{'peak':<{width}} {self.peak_bytes / GiB:>12.2f}   ({verdict} in {self.gpu_memory_gib:g} GiB"
                  f"{f', --launch {launch}' if launch else ''})",
                  f"time: {self.tokens:,} tokens x {self.flops_per_token / 1e9:.1f} GFLOP/token "
                  f"({self.attention_flops_per_token / 1e9:.1f} of them attention) on {self.gpus} GPUs at "
                  f"{self.assumptions['utilisation']['matmuls']:.0%} (matmuls) and "
                  f"{self.assumptions['utilisation']['attention']:.0%} (attention, {self.assumptions['attention']}) of "
                  f"{self.assumptions['peak_tflops']:g} TFLOP/s ({self.assumptions['utilisation']['source']}) "
                  f"= {self.hours:.1f} h"]
        lines += inter_node_lines(self.assumptions.get("inter_node"), self.hours)
        lines += [f"lever: {lever}" for lever in self.levers()]
        return "\n".join(lines)


def _either(*options: str | None) -> str | None:
    """The usable options joined with ", or " (None when there is none)."""
    usable = [option for option in options if option]
    return ", or ".join(usable) or None


def _allowed(check: Any, *args: Any) -> bool:
    """Whether ``check(*args)`` (a launch check) accepts, rather than raises."""
    try:
        check(*args)
    except ValueError:
        return False
    return True


def estimate(
    recipe: Any,
    gpus: int = 8,
    gpu_memory_gib: float = 80.0,
    gpu: str = "h100",
    mfu: float | None = None,
    samples: int | None = None,
    shape: ModelShape | None = None,
    launch: str | None = None,
) -> Plan:
    """Estimate per-GPU peak memory and wall time of ``recipe`` (a validated Recipe) on ``gpus`` GPUs.

    Args:
        samples: rows of the training data (default: a local JSONL ``data.source``'s rows, the demo set's
            conversations, else 1000); unused when ``train.max_steps`` is set.
        launch: how the GPUs share the work, as ``longpeft train --launch`` (``ddp``, ``fsdp2``, ``zero3``,
            ``ulysses``); default ``ddp`` on several GPUs. A combination ``train --launch`` refuses is refused here.
    """
    if gpu not in GPU_PEAK_TFLOPS:
        raise ValueError(f"--gpu {gpu!r}: choose one of {', '.join(GPU_PEAK_TFLOPS)}")
    launch = launch or ("ddp" if gpus > 1 else None)
    if launch:
        check_launch(recipe, launch)
    shards = gpus if launch in SHARDED_LAUNCHES else 1  # GPUs that split weights, gradients and AdamW state
    sequence_shards = gpus if launch == "ulysses" else 1  # GPUs that split each sequence
    shape = shape or shape_of(recipe.model.name_or_path)
    dtype_bytes = 4 if recipe.model.dtype == "float32" else 2
    tokens_per_sample = recipe.data.max_length
    batch = recipe.train.per_device_batch_size
    activation_tokens = -(-batch * tokens_per_sample // sequence_shards)

    terms: dict[str, int] = {}
    whole: dict[str, int] = {}  # bytes of a term that sharding leaves whole on every GPU
    linear_bytes = dtype_bytes  # per parameter of the decoder layers' linear projections, as stored
    if recipe.model.load_in_4bit:
        # one absmax per 64 weights: fp32, or with double quantization 8-bit plus one fp32 per 256 of those;
        # they are no parameters (bitsandbytes' quant state), so FSDP2 and ZeRO-3 shard only the packed weights
        constants = 1 / 64 + 4 / (256 * 64) if recipe.model.bnb_4bit_use_double_quant else 4 / 64
        linear_bytes = 0.5 + constants
        terms["base weights"] = int(shape.linear_params * linear_bytes + shape.other_params * dtype_bytes)
        whole["base weights"] = int(shape.linear_params * constants)
    else:  # a full fine-tune's trained weights: below
        terms["base weights"] = (shape.linear_params + shape.other_params) * dtype_bytes
    trainable = trainable_matmul = lora_params = 0
    trained_bytes = 4  # per trained weight as stored: float32
    deepspeed = launch in DEEPSPEED_LAUNCHES

    def with_state(weight_bytes: int) -> int:
        """Bytes per trained parameter: its weight, gradient and AdamW's two moments, all in the weight's dtype;
        under DeepSpeed the gradient in the compute dtype, and a float32 master copy and float32 moments whatever the
        weight's dtype (measured: tests/zero3_bytes_worker.py)."""
        return weight_bytes + dtype_bytes + 4 + 8 if deepspeed else 4 * weight_bytes

    if recipe.finetune == "lora":
        trained_bytes = 2 if recipe.lora.trainable_dtype == "bfloat16" else 4
        if deepspeed and recipe.model.load_in_4bit:  # DeepSpeed casts every weight of a model zero.Init did not build
            trained_bytes = dtype_bytes
        lora_params = shape.layers * sum(recipe.lora.r * sum(shape.projection_shape(n)) for n in recipe.lora.target_modules)
        terms["LoRA"] = lora_params * with_state(trained_bytes)
        trainable = trainable_matmul = lora_params
        if recipe.lora.embeddings == "full":
            terms["trainable embedding"] = shape.vocab * shape.hidden * with_state(trained_bytes)
            trainable += shape.vocab * shape.hidden
        elif recipe.lora.embeddings == "token_indices":
            rows = len(recipe.lora.trainable_token_indices or [])
            terms["trainable embedding"] = rows * shape.hidden * with_state(trained_bytes)
            trainable += rows * shape.hidden
    elif recipe.finetune == "full":  # gradients and AdamW moments beside the weights
        full = shape.linear_params + shape.other_params
        # float32 weights; under DeepSpeed zero.Init builds them in the compute dtype (beside a float32 master copy)
        weight_bytes = dtype_bytes if deepspeed else 4
        terms["base weights"] = full * weight_bytes
        terms["optimizer state and gradients"] = full * (with_state(weight_bytes) - weight_bytes)
        trainable = full
        trainable_matmul = shape.linear_params + shape.vocab * shape.hidden
    method_levers = {}
    method_params = 0  # a method's own weights, trained and frozen
    for name, config in recipe.method_configs().items():  # a method's own weights (beacon) train in every mode
        method = get_method(name)
        if method.planned_parameters is not None:
            method_trainable, method_frozen = method.planned_parameters(config, shape)
            terms[f"{name} weights"] = method_trainable * 16 + method_frozen * 4  # float32; AdamW on the trainable
            method_params += method_trainable + method_frozen
            trainable += method_trainable
            trainable_matmul += method_trainable
            method_levers[f"{name} weights"] = method.plan_lever or f"a smaller {name} section"
    kv = shape.kv_heads * shape.head_dim
    offloaded = recipe.train.activation_offloading and recipe.train.gradient_checkpointing
    if recipe.train.gradient_checkpointing:  # offloaded: in use, being fetched, and TRL's stash stay on the GPU
        kept_layers = 2 + TRL_OFFLOAD_STASH if offloaded else shape.layers
        terms["checkpointed layer inputs"] = kept_layers * activation_tokens * shape.hidden * dtype_bytes
        per_token = (5 * shape.hidden + 2 * kv + 4 * shape.intermediate) * dtype_bytes
        terms["one layer's recompute"] = activation_tokens * per_token
    else:
        per_token = (5 * shape.hidden + 2 * kv + 4 * shape.intermediate) * dtype_bytes
        terms["all layers' activations"] = shape.layers * activation_tokens * per_token
    if recipe.model.attn_implementation == "eager":  # scores and probabilities; every layer's without checkpointing
        layers_kept = 1 if recipe.train.gradient_checkpointing else shape.layers
        terms["eager attention scores"] = layers_kept * batch * shape.heads * tokens_per_sample**2 * dtype_bytes * 2
    terms["loss tiles"] = 3 * TILE_TOKENS * TILE_VOCAB * 4 + 2 * activation_tokens * shape.hidden * dtype_bytes
    if shards > 1:  # weights, gradients and AdamW state are split; the units in use are gathered whole
        for term in list(terms):
            if term not in ACTIVATION_TERMS:
                kept = whole.get(term, 0)
                terms[term] = kept + -(-(terms[term] - kept) // shards)
        layer_bytes = shape.linear_params // shape.layers * linear_bytes + (lora_params + method_params) // shape.layers * dtype_bytes
        # TRL's fused loss gathers the LM head itself (DTensor.full_tensor), as stored: float32 when it trains
        head_bytes = shape.vocab * shape.hidden * (4 if recipe.finetune == "full" and not deepspeed else dtype_bytes)
        trained_layer = (shape.linear_params if recipe.finetune == "full" else lora_params) // shape.layers + (
            method_params // shape.layers)
        trained_embedding = shape.vocab * shape.hidden if recipe.finetune == "full" or recipe.lora.embeddings == "full" else 0
        unsharded_gradients = max(trained_layer * dtype_bytes, trained_embedding * dtype_bytes,
                                  head_bytes if recipe.finetune == "full" else 0)
        terms["gathered layers and LM head"] = int(2 * layer_bytes + head_bytes + unsharded_gradients)
        if deepspeed:  # one contiguous gradient bucket, in the compute dtype
            terms["DeepSpeed reduce bucket"] = DEEPSPEED_REDUCE_BUCKET * dtype_bytes
    elif gpus > 1:
        terms["DDP gradient buckets"] = trainable * trained_bytes
    activations = sum(terms.get(term, 0) for term in ACTIVATION_TERMS)
    terms["runtime (CUDA context, fragmentation)"] = GiB + activations // 10 + ALLOCATOR_RESERVE

    layers = shape.linear_params + lora_params  # the decoder layers' matmuls (what checkpointing recomputes)
    head = shape.vocab * shape.hidden  # the LM head's matmul (the input embedding is a lookup: no FLOPs)
    # eager attention computes the whole score matrix; SDPA and flash-attn kernels skip the causal mask's upper half
    context = tokens_per_sample if recipe.model.attn_implementation == "eager" else tokens_per_sample / 2
    attention = 4 * shape.layers * context * shape.heads * shape.head_dim
    recompute = 2 * layers if recipe.train.gradient_checkpointing else 0
    attention_flops = attention * (4 if recompute else 3)
    # forward, recompute, the fused loss recomputing the logits, backward to the activations, trained weights' gradients
    flops_per_token = (2 * (layers + head) + recompute + 2 * head + 2 * (layers + head) + 2 * trainable_matmul
                       + attention_flops)
    if samples is None:
        samples = _samples(recipe)
    trained_samples = (recipe.train.max_steps * recipe.train.global_batch_size if recipe.train.max_steps > 0
                       else round(samples * recipe.train.num_train_epochs))
    tokens = trained_samples * tokens_per_sample
    utilisation = _utilisation(gpu, recipe.model.load_in_4bit, recipe.model.attn_implementation, mfu)
    seconds = tokens * ((flops_per_token - attention_flops) / utilisation["matmuls"]
                        + attention_flops / utilisation["attention"]) / (gpus * GPU_PEAK_TFLOPS[gpu] * 1e12)
    return Plan(
        gpus=gpus,
        gpu_memory_gib=gpu_memory_gib,
        terms=terms,
        tokens=tokens,
        flops_per_token=flops_per_token,
        attention_flops_per_token=attention_flops,
        hours=seconds / 3600,
        method_levers=method_levers,
        assumptions={"gpu": gpu, "peak_tflops": GPU_PEAK_TFLOPS[gpu], "utilisation": utilisation,
                     "attention": recipe.model.attn_implementation, "samples": samples,
                     "tokens_per_sample": tokens_per_sample, "per_device_batch": batch, "trainable_params": trainable,
                     "trained_samples": trained_samples,
                     "trainable_dtype": f"{'float32' if trained_bytes == 4 else 'bfloat16'} ({with_state(trained_bytes)} "
                                        "bytes/param with AdamW)", "finetune": recipe.finetune,
                     "load_in_4bit": recipe.model.load_in_4bit, "activation_offloading": offloaded,
                     "launch": launch, "sequence_parallel": sequence_shards,
                     "can_shard": _allowed(check_sharded, recipe, "sharding"),
                     "can_split_sequences": _allowed(check_sequence_parallel, recipe)},
    )


def _utilisation(gpu: str, four_bit: bool, attention: str, mfu: float | None) -> dict[str, float | str]:
    """Fractions of the peak FLOP/s: ``{"matmuls", "attention", "source"}``. ``mfu`` (``--mfu``) sets both; else
    the figures measured on this GPU (eager attention counts as matmuls), else the unmeasured defaults."""
    if mfu is not None:
        return {"matmuls": mfu, "attention": mfu, "source": "--mfu"}
    if gpu not in MEASURED_UTILISATION:
        default = UNMEASURED_UTILISATION[four_bit]
        return {"matmuls": default, "attention": default, "source": f"assumed: not measured on {gpu}"}
    measured = MEASURED_UTILISATION[gpu]
    matmuls = measured["matmuls"][four_bit]
    return {"matmuls": matmuls, "attention": measured["attention"].get(attention, matmuls), "source": "measured on an H100"}


def _samples(recipe: Any) -> int:
    """Rows of the training data: a local JSONL file's, the demo set's ``n_conversations``, else 1000 (pass
    ``--samples`` for the real count); at most ``data.max_samples`` (the runner reads no more)."""
    path = Path(recipe.data.source)
    cap = recipe.data.max_samples
    if path.is_file() and path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as handle:
            rows = sum(1 for line in handle if line.strip())
    elif recipe.data.source == "demo":
        from ..synth_data.demo import DEMO_CONVERSATIONS

        rows = int(recipe.data.demo.get("n_conversations", DEMO_CONVERSATIONS))
    else:
        return cap or 1000
    return min(rows, cap) if cap else rows
