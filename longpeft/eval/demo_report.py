"""The demo's retrieval scores: passkey, NIAH and held-out questions in the format the demo trains
on, for the base model and the fine-tuned adapter, each with and without STRING (``make demo``
prints them as a table)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..adapters.string import DEFAULT_LOCAL_WINDOW, disable_string, enable_string
from .generation import greedy_generate
from .scoring import exact_match
from .tasks import evaluate

PASSKEY_LENGTHS = (256, 512, 1024)
NIAH_LENGTHS = (512, 1024)
# Held-out demo conversations: ~120 context tokens fit the base model's 256-token window, ~700 do not.
RETRIEVAL_CONTEXT_TOKENS = (120, 700)
HELD_OUT_SEED = 1000  # the demo trains on seed 0


def demo_string_settings(trained_length: int) -> dict[str, int]:
    """STRING for a tiny model: S = L / 3 and W = min(128, S / 4) (the paper's W = 128 needs L >= 2K)."""
    shift = trained_length // 3
    return {"shift": shift, "local_window": min(DEFAULT_LOCAL_WINDOW, shift // 4), "trained_length": trained_length}


def held_out_set(tokenizer: Any, context_tokens: int, n: int = 8, seed: int = HELD_OUT_SEED) -> tuple[list[list[int]], list[str]]:
    """Prompts (first question of each conversation, chat template) and answers of held-out demo
    conversations: the demo's procedural generator with another seed; each answer is a number
    stated once in the context."""
    from ..synth_data.demo import demo_conversations

    rows = demo_conversations(tokenizer, n_conversations=2 * n, context_tokens=context_tokens, seed=seed, questions_per_conversation=1)[:n]
    if not rows:
        raise ValueError(f"the demo generator produced no conversation of {context_tokens} context tokens")
    prompts = [
        list(tokenizer.apply_chat_template(r["messages"][:1], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for r in rows
    ]
    return prompts, [r["messages"][1]["content"] for r in rows]


def held_out_retrieval(model: Any, tokenizer: Any, prompts: list[list[int]], answers: list[str]) -> float:
    """Exact-match accuracy of greedy answers to :func:`held_out_set` prompts."""
    predictions = greedy_generate(model, tokenizer, prompts, max_new_tokens=12, batch_size=8, desc="held-out retrieval")
    return sum(exact_match(p, a) for p, a in zip(predictions, answers)) / len(answers)


def retrieval_report(out: str | Path, adapter_dir: str | Path, n_samples: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Score the demo's base model (``out/base``) and base + adapter on passkey, single-needle NIAH
    and held-out demo-format retrieval (:func:`held_out_set`), each with and without STRING.

    Writes ``out/eval/<setting>/`` (JSON + heatmaps) and returns rows
    ``{"task", "setting", "length", "score"}``, one per task, setting and length (for "retrieval",
    the mean prompt length).
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
    held_out = {tokens: held_out_set(tokenizer, tokens) for tokens in RETRIEVAL_CONTEXT_TOKENS}
    rows: list[dict[str, Any]] = []
    for name, model in models.items():
        # STRING's L: the adapter's trained length (longpeft.json), the base's own window otherwise.
        spec = getattr(model, "longpeft_spec", None)
        string = demo_string_settings(getattr(spec, "trained_length", None) or model.config.max_position_embeddings)
        for use_string in (False, True):
            setting = f"{name} + STRING" if use_string else name
            folder = out / "eval" / setting.replace(" + ", "_")
            common = dict(n_samples=n_samples, seed=seed, chat=chat, batch_size=9, out_dir=folder, string=string if use_string else None)
            passkey = evaluate("passkey", model, tokenizer, lengths=PASSKEY_LENGTHS, depths=(0.0, 0.5, 1.0), **common)
            niah = evaluate("niah_single", model, tokenizer, lengths=NIAH_LENGTHS, depths=(0.0, 0.5, 1.0), **common)
            for result in (passkey, niah):
                for length, value in result["by_length"].items():
                    rows.append({"task": result["task"], "setting": setting, "length": int(length), "score": value})
            if use_string:
                enable_string(model, **string)
            try:
                for prompts, answers in held_out.values():
                    length = round(sum(len(p) for p in prompts) / len(prompts))
                    score = held_out_retrieval(model, tokenizer, prompts, answers)
                    rows.append({"task": "retrieval", "setting": setting, "length": length, "score": score})
            finally:
                disable_string(model)
    return rows
