"""The demo's retrieval scores: passkey and NIAH for the base model and the fine-tuned adapter,
each with and without STRING (``make demo`` prints them as a table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..adapters.string import DEFAULT_LOCAL_WINDOW
from .tasks import evaluate

PASSKEY_LENGTHS = (256, 512, 1024)
NIAH_LENGTHS = (512, 1024)


def demo_string_settings(trained_length: int) -> dict[str, int]:
    """STRING for a tiny model: S = L / 3 and W = min(128, S / 4) (the paper's W = 128 needs L >= 2K)."""
    shift = trained_length // 3
    return {"shift": shift, "local_window": min(DEFAULT_LOCAL_WINDOW, shift // 4), "trained_length": trained_length}


def retrieval_report(out: str | Path, adapter_dir: str | Path, n_samples: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Score the demo's base model (``out/base``) and base + adapter on passkey and single-needle NIAH.

    Writes ``out/eval/<setting>/`` (JSON + heatmaps) and returns rows
    ``{"task", "setting", "length", "score"}``, one per task, setting and length.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import load

    out = Path(out)
    base_dir = out / "base"
    tokenizer = AutoTokenizer.from_pretrained(str(adapter_dir))
    chat = bool(getattr(tokenizer, "chat_template", None))
    models = {
        "base": AutoModelForCausalLM.from_pretrained(str(base_dir)).eval(),
        "adapter": load(str(base_dir), adapter_dir).eval(),
    }
    rows: list[dict[str, Any]] = []
    for name, model in models.items():
        string = demo_string_settings(model.config.max_position_embeddings)
        for use_string in (False, True):
            setting = f"{name} + STRING" if use_string else name
            folder = out / "eval" / setting.replace(" + ", "_")
            common = dict(n_samples=n_samples, seed=seed, chat=chat, batch_size=9, out_dir=folder, string=string if use_string else None)
            passkey = evaluate("passkey", model, tokenizer, lengths=PASSKEY_LENGTHS, depths=(0.0, 0.5, 1.0), **common)
            niah = evaluate("niah_single", model, tokenizer, lengths=NIAH_LENGTHS, depths=(0.0, 0.5, 1.0), **common)
            for result in (passkey, niah):
                for length, value in result["by_length"].items():
                    rows.append({"task": result["task"], "setting": setting, "length": int(length), "score": value})
    return rows
