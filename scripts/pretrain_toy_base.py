"""Pretrain the toy base that `make demo` and the tests extend: a small Llama-shaped model (RoPE,
grouped-query attention) that retrieves inside its trained window W and fails beyond it.

    python scripts/pretrain_toy_base.py --out runs/toy-base            # about 25 minutes on 2 CPU cores
    python scripts/pretrain_toy_base.py --out runs/toy-base --resume   # after a kill: same result
    python scripts/pretrain_toy_base.py --out longpeft/toy_base        # replace the shipped base

Data: retrieval documents (``longpeft.synth_data.retrieval_docs``: answered passkey and
needle-in-a-haystack probes, and random word spans that recur), every token scored, with a length
curriculum from W/4 to W over the first ``--curriculum`` fraction of the steps. The data of step s is
a function of (seed, s) only, so a resumed run sees what an uninterrupted one would have.

The output folder holds the model (safetensors), its tokenizer, ``training_log.jsonl``,
``scores.json`` (passkey and single-needle NIAH at W, 2W and 4W, greedy, exact match) and a model
card (README.md) generated from those scores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from longpeft.eval.tasks import evaluate
from longpeft.synth_data.retrieval_docs import RetrievalDocuments
from longpeft.tiny import demo_tokenizer

CHECKPOINT = "checkpoint.pt"
FINAL_SAMPLES = 8  # final scores: prompts per (length, depth)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/toy-base", help="output folder (default: runs/toy-base)")
    p.add_argument("--window", type=int, default=256, help="trained window W in tokens (max_position_embeddings)")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument(
        "--tokens-per-step", type=int, default=8192, help="batch size x length (the batch grows as documents shorten)"
    )
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument(
        "--curriculum", type=float, default=0.3, help="fraction of steps over which lengths grow from W/4 to W"
    )
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=384)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    args = p.parse_args(argv)
    for name in (
        "window",
        "steps",
        "tokens_per_step",
        "hidden",
        "layers",
        "heads",
        "kv_heads",
        "intermediate",
        "eval_every",
        "save_every",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.heads % args.kv_heads or args.hidden % args.heads:
        p.error("--heads must be a multiple of --kv-heads, and --hidden a multiple of --heads")
    if not (0 < args.lr < 1 and 0 <= args.curriculum <= 1):
        p.error("--lr must be in (0, 1) and --curriculum in [0, 1]")
    return args


def model_config(args: argparse.Namespace, tokenizer) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=args.window,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("</s>")],
    )


def step_length(step: int, args: argparse.Namespace) -> int:
    """Document length at ``step``: W/4 growing linearly to W over the curriculum, in steps of 16."""
    ramp = args.curriculum * args.steps
    frac = 1.0 if ramp == 0 else min(1.0, step / ramp)
    length = args.window // 4 + frac * (args.window - args.window // 4)
    return max(16, int(length) // 16 * 16)


def step_batch(step: int, args: argparse.Namespace, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, each ``[batch, length]``, a function of (seed, step) only. Documents
    have random lengths in [length/2, length]; the rest of a row is padding with label -100."""
    length = step_length(step, args)
    batch = max(1, args.tokens_per_step // length)
    docs = RetrievalDocuments(tokenizer, seed=args.seed * 1_000_003 + step)
    rng = random.Random(f"{args.seed}/{step}/lengths")
    input_ids = torch.full((batch, length), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((batch, length), -100, dtype=torch.long)
    for row in range(batch):
        ids = docs.document(rng.randint(length // 2, length))
        input_ids[row, : len(ids)] = torch.tensor(ids)
        labels[row, : len(ids)] = torch.tensor(ids)
    return input_ids, labels


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to 10% of ``--lr``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def retrieval_scores(
    model, tokenizer, lengths: list[int], n_samples: int, seed: int = 1234
) -> dict[str, dict[int, float]]:
    """Passkey and single-needle NIAH accuracy by length (greedy, exact match; depths 0, 0.5, 1)."""
    scores = {}
    for task in ("passkey", "niah_single"):
        result = evaluate(
            task,
            model,
            tokenizer,
            lengths=lengths,
            depths=(0.0, 0.5, 1.0),
            n_samples=n_samples,
            seed=seed,
            chat=False,
            batch_size=16,
        )
        scores[task] = {int(k): v for k, v in result["by_length"].items()}
    return scores


def save_checkpoint(out: Path, model, optimizer, step: int, seconds: float) -> None:
    """`seconds`: training time of steps [0, step), summed over resumed runs."""
    tmp = out / (CHECKPOINT + ".tmp")
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "seconds": seconds}, tmp
    )
    os.replace(tmp, out / CHECKPOINT)  # atomic: a kill mid-save leaves the previous checkpoint


def write_card(out: Path, args: argparse.Namespace, scores: dict, n_params: int, seconds: float) -> None:
    w = args.window
    rows = "\n".join(
        f"| {task} | " + " | ".join(f"{scores[task][n]:.2f}" for n in sorted(scores[task])) + " |" for task in scores
    )
    header = " | ".join(f"{n} ({n // w}W)" if n % w == 0 else str(n) for n in sorted(next(iter(scores.values()))))
    (out / "README.md").write_text(f"""---
library_name: transformers
tags: [longpeft, toy-model, long-context]
---
# longpeft toy base (W = {w})

A {n_params / 1e6:.2f}M-parameter Llama-shaped model (RoPE base {args.rope_theta:g}, {args.layers} layers, hidden
{args.hidden}, {args.heads} query heads over {args.kv_heads} key/value heads) pretrained from scratch on CPU to
retrieve inside a {w}-token window and fail beyond it, so that context-extension methods have something
real to extend. It is what `make demo` and the tests start from; it knows nothing but its training data.

Made by `python scripts/pretrain_toy_base.py --out DIR --seed {args.seed} --steps {args.steps}` \
({seconds / 60:.0f} min on
{torch.get_num_threads()} CPU threads): {args.steps} steps of {args.tokens_per_step} tokens of retrieval documents
(`longpeft.synth_data.retrieval_docs`: answered passkey and needle-in-a-haystack probes, recurring
random word spans), every token scored, lengths growing from {w // 4} to {w} tokens, AdamW lr {args.lr:g}
(cosine), tokenizer `longpeft.tiny.demo_tokenizer()`.

Greedy exact-match accuracy ({3 * FINAL_SAMPLES} prompts per length: {FINAL_SAMPLES} at each needle depth 0, 0.5 and 1;
probe seed 1234, never seen in training):

| task | {header} |
|---|{"---|" * len(next(iter(scores.values())))}
{rows}
""")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = demo_tokenizer()
    tokenizer.chat_template = None  # a base model: plain prompts, no chat turns
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM._from_config(model_config(args, tokenizer), attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    start, seconds_before = 0, 0.0
    log_path = out / "training_log.jsonl"
    if args.resume and (out / CHECKPOINT).is_file():
        state = torch.load(out / CHECKPOINT, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, seconds_before = state["step"], state.get("seconds", 0.0)
        print(f"resuming from step {start}", file=sys.stderr)
        if log_path.exists():  # drop log lines of steps after the checkpoint (they will be redone)
            kept = [
                line for line in log_path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < start
            ]
            log_path.write_text("".join(line + "\n" for line in kept))
    elif log_path.exists():
        log_path.unlink()
    began = time.time()
    model.train()
    with (
        log_path.open("a") as log,
        tqdm(range(start, args.steps), initial=start, total=args.steps, desc="pretraining") as bar,
    ):
        for step in bar:
            input_ids, labels = step_batch(step, args, tokenizer)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, args)
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            record = {
                "step": step,
                "loss": round(loss.item(), 4),
                "grad_norm": round(norm.item(), 3),
                "length": input_ids.shape[1],
            }
            if (step + 1) % args.eval_every == 0:
                model.eval()
                record["scores"] = retrieval_scores(model, tokenizer, [args.window], n_samples=4)
                model.train()
                tqdm.write(json.dumps(record), file=sys.stderr)
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{record['loss']:.3f}", length=record["length"])
            if (step + 1) % args.save_every == 0:
                save_checkpoint(out, model, optimizer, step + 1, seconds_before + time.time() - began)
    seconds = seconds_before + time.time() - began  # the whole run's training time, resumes included
    model.eval()
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    scores = retrieval_scores(
        AutoModelForCausalLM.from_pretrained(out).eval(),
        tokenizer,
        [args.window, 2 * args.window, 4 * args.window],
        n_samples=FINAL_SAMPLES,
    )
    (out / "scores.json").write_text(
        json.dumps(
            {
                "window": args.window,
                "seed": args.seed,
                "steps": args.steps,
                "train_seconds": round(seconds),
                "scores": scores,
            },
            indent=2,
        )
        + "\n"
    )
    write_card(out, args, scores, sum(p.numel() for p in model.parameters()), seconds)
    (out / CHECKPOINT).unlink(missing_ok=True)
    print(json.dumps({"out": str(out), "scores": scores}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
