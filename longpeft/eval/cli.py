"""``longpeft eval TASK --model PATH [--adapter DIR] [--string] [--lengths ...] --out DIR``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .names import TASKS


def load_model_and_tokenizer(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model (base, base + longpeft adapter via ``longpeft.load``, or merged) and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"dtype": getattr(torch, args.dtype) if args.dtype != "auto" else "auto"}
    if args.attn_implementation:
        kwargs["attn_implementation"] = args.attn_implementation
    if args.device:
        kwargs["device_map"] = args.device
    if args.adapter:
        from .. import load

        model = load(args.model, args.adapter, **kwargs)
        adapter = Path(args.adapter)
        has_tokenizer = adapter.is_dir() and any((adapter / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
        tokenizer = AutoTokenizer.from_pretrained(str(adapter) if has_tokenizer else args.model)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    return model.eval(), tokenizer


def run_eval(args: argparse.Namespace) -> int:
    string: bool | dict[str, Any] | None = None
    if args.string:
        string = {
            k: v
            for k, v in (
                ("shift", args.string_shift),
                ("local_window", args.string_window),
                ("trained_length", args.string_trained_length),
            )
            if v is not None
        } or True
    if args.task == "perplexity" and not args.text:
        raise SystemExit("longpeft eval perplexity needs --text FILE")
    model, tokenizer = load_model_and_tokenizer(args)
    options: dict[str, Any] = {}
    if args.task not in ("perplexity",):
        options.update(n_samples=args.samples, seed=args.seed, batch_size=args.batch_size, chat=args.chat)
        if args.depths:
            options["depths"] = args.depths
        if args.max_new_tokens:
            options["max_new_tokens"] = args.max_new_tokens
    from .tasks import evaluate

    result = evaluate(
        args.task,
        model,
        tokenizer,
        lengths=args.lengths,
        string=string,
        out_dir=args.out,
        text=args.text,
        window=args.window,
        stride=args.stride,
        **options,
    )
    summary = {k: v for k, v in result.items() if k not in ("samples", "cells", "tasks")}
    print(json.dumps(summary, indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``eval`` subcommand."""
    parser = subparsers.add_parser(
        "eval",
        help="score a model on passkey / NIAH / RULER-lite / topic retrieval / perplexity (JSON + PNG)",
        description=(
            "Evaluate a causal LM (base, base + longpeft adapter, or merged) on long-context probes with "
            "batched greedy generation, optionally with STRING. Writes <task>.json and heatmaps/plots to --out."
        ),
    )
    parser.add_argument("task", choices=TASKS, help="what to run ('ruler' = the six RULER-lite tasks, 'niah' = niah_single)")
    parser.add_argument("--model", required=True, help="base or merged model: Hub id or local folder")
    parser.add_argument("--adapter", help="longpeft adapter folder or Hub id (loaded with longpeft.load)")
    parser.add_argument("--string", action="store_true", help="switch STRING on (S = trained length / 3, W = 128)")
    parser.add_argument("--string-shift", type=int, help="STRING shift S (default trained length // 3)")
    parser.add_argument("--string-window", type=int, help="STRING local window W (default 128)")
    parser.add_argument("--string-trained-length", type=int, help="trained length L for STRING's default S")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt lengths in tokens")
    parser.add_argument("--depths", type=float, nargs="+", help="needle depths in [0, 1] (default 0 .25 .5 .75 1)")
    parser.add_argument("--samples", type=int, default=10, help="probes per (length, depth) cell")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, help="continuation budget (default per task)")
    parser.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    parser.add_argument("--text", help="perplexity: UTF-8 text file")
    parser.add_argument("--window", type=int, default=4096, help="perplexity: tokens per window")
    parser.add_argument("--stride", type=int, help="perplexity: step between windows (default window // 2)")
    parser.add_argument("--dtype", default="auto", help="torch dtype to load in (auto, bfloat16, float32, ...)")
    parser.add_argument("--attn-implementation", help="eager, sdpa or flash_attention_2")
    parser.add_argument("--device", help="device_map for loading, e.g. cpu, cuda, auto")
    parser.add_argument("--out", required=True, help="output folder for JSON and PNGs")
    parser.set_defaults(func=run_eval)
