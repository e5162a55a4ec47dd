"""What a finished run saves: the trained weights and what loads them into ``adapter/`` (``model/`` with
``finetune: full``), and the run's summary (``metrics.json``, ``loss.png``)."""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from transformers import PreTrainedTokenizerBase

from ..adapter_weights import tied_copies, tied_copies_bytes, write_tied_copies
from ..adapters import export_methods, save_method_weights
from ..config import torch_dtype
from ..files import write_text_atomically, writing_to, written_atomically
from ..hub import name_base_in_adapter_config, plain_peft_misses, write_model_card
from ..spec import ContextSpec
from .checkpoints import trim_metrics
from .schema import Recipe


@dataclass
class Prepared:
    """A run built and ready to train (:func:`~.runner.prepare`), which :func:`save_run` saves once trained."""

    recipe: Recipe
    output_dir: Path
    trainer: Any
    tokenizer: PreTrainedTokenizerBase
    spec: ContextSpec
    data_stats: dict[str, int]
    resolved: dict[str, Any]


def save_run(prepared: Prepared, train_metrics: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The trained weights of the trainer's model into ``output_dir/adapter`` (``model`` with ``finetune: full``) by
    :func:`save_adapter` on the main process (after every process took part in gathering a sharded model), then
    ``metrics.json`` and ``loss.png`` from ``metrics.jsonl``, the Trainer's ``train_metrics`` and the run's
    ``resolved`` settings. Returns the folder and the summary (``train_metrics`` on the other processes)."""
    trainer, spec, recipe, output_dir = prepared.trainer, prepared.spec, prepared.recipe, prepared.output_dir
    adapter_dir = output_dir / ("model" if recipe.finetune == "full" else "adapter")
    sharded = trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled  # FSDP, DeepSpeed ZeRO-3
    wrapped = trainer.deepspeed if trainer.is_deepspeed_enabled else trainer.model
    state_dict = trainer.accelerator.get_state_dict(wrapped) if sharded else None  # every process takes part
    if not trainer.is_world_process_zero():
        return adapter_dir, dict(train_metrics)
    dtype = torch_dtype(recipe.model.dtype)
    save_adapter(trainer.model, prepared.tokenizer, spec, adapter_dir, state_dict, recipe.finetune, dtype)
    steps = trainer.state.global_step
    trim_metrics(output_dir / "metrics.jsonl", steps)
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [(r["step"], r["loss"]) for r in records if "loss" in r]
    summary = {
        "recipe": recipe.name,
        "steps": steps,
        "first_loss": losses[0][1] if losses else None,
        "final_loss": losses[-1][1] if losses else None,
        "train": {k: v for k, v in train_metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)},
        "data": prepared.resolved["data"],
        "rope_parameters": spec.rope_parameters,
        "max_position_embeddings": spec.max_position_embeddings,
        "trainable_parameters": prepared.resolved["trainable_parameters"],
    }
    write_text_atomically(output_dir / "metrics.json", json.dumps(summary, indent=2) + "\n")
    with writing_to(output_dir):  # the loss curve (matplotlib's Figure API: no pyplot state)
        fig = Figure(figsize=(6, 3.5), dpi=100)
        ax = fig.subplots()
        if losses:
            ax.plot(*zip(*losses), marker="o", markersize=2, linewidth=1.2)
        ax.set(xlabel="optimizer step", ylabel="training loss", title=f"{recipe.name}: training loss")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(output_dir / "loss.png")
    return adapter_dir, summary


def save_adapter(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    spec: ContextSpec,
    adapter_dir: Path,
    state_dict: dict[str, Any] | None = None,
    finetune: str = "lora",
    dtype: torch.dtype = torch.float32,
) -> None:
    """Adapter weights (or the full model), method weights, tokenizer, generation config, longpeft.json (its
    ``weights``: ``finetune``) and the model card, written beside ``adapter_dir`` and swapped in once complete.

    LoRA weights are in peft's own format (a tied embedding under both names); longpeft.json and adapter_config.json
    name the base without a path of this machine; a warning says what plain ``PeftModel.from_pretrained`` would
    leave out. ``state_dict``: the gathered weights of a sharded model. A full model is saved in ``dtype`` (the
    recipe's ``model.dtype``) with what its methods export (HARPE's modeling file); ``finetune: method`` writes only
    the methods' own weights. Raises OutputWriteError: a full disk or a refused write.
    """
    adapter_dir = Path(adapter_dir).absolute()
    with written_atomically(adapter_dir, _saved_bytes(model, state_dict), replace=True) as folder:
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
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(folder)
        saved_spec = spec.model_copy(update={"weights": finetune})
        saved_spec.save(folder)
        name_base_in_adapter_config(folder, saved_spec.base_model)  # as longpeft.json does: no path of this machine
        write_model_card(folder, saved_spec, folder_name=adapter_dir.name)  # replaces peft's placeholder README.md
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
