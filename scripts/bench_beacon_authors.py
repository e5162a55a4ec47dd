"""Benchmark: our Activation Beacon against the authors' code, same model and input: time and peak memory of a
long prefill and of one training step (run by hand; not a test).

The authors' side needs transformers 4.39 in a second environment, set up as in ``parity_beacon_authors.py``
(whose model builder and converter loading this script reuses, so both sides hold the same weights):

    .venv/bin/python scripts/bench_beacon_authors.py --authors-python /tmp/venv-authors/bin/python \\
        --authors-src FlagEmbedding/research/Long_LLM/activation_beacon/src

The model: Llama-shaped, hidden 512, 8 query / 2 KV heads of 64 dims, MLP 1376, 4 layers, a 1024-token vocabulary
(small, so that the LM head does not hide the beacon machinery), float32, eager attention on both sides (the
authors' masks are explicit). Beacons: window 128, ratio 8, full-coverage + interleave (the released layout),
q/k/v beacon projections. The input: ``--windows`` windows of random tokens (default 32: 4096 tokens).

- prefill: eval mode, no gradient; ours keeps the last position's hidden state and logits, as ``generate`` asks
  it to (``logits_to_keep=1``); theirs computes every window's logits and keeps the
  last window's (it cannot do otherwise; with this vocabulary that costs little).
- training step: train mode, loss over every token, backward to the beacon weights (the base frozen on both
  sides), through the memory of earlier windows. Ours runs all windows in one forward; theirs one forward per
  window.
- decode per token: greedy ``generate`` of 33 new tokens after the prompt; the time from the first new token's
  scores to the last one's (stamped by a logits processor), per token; time only.

Time is the median of ``--repeats`` runs (default 5) after one warm-up, on ``--threads`` CPU threads; memory is the
peak tensor memory above what was held before the call (torch.profiler's allocation events on CPU). Ratios are ours
over the authors' (below 1: ours is faster or leaner); the last line is one JSON object with them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the parity script beside this one
from parity_beacon_authors import (  # noqa: E402
    add_authors_arguments,
    authors_side_or_error,
    build_authors_model,
    load_converted,
    run_authors_side,
)

SHAPE = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=1024,
    rope_theta=500000.0,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
    tie_word_embeddings=False,
    attention_bias=False,
)
WINDOW, RATIO, POSITIONS = 128, 8, 2048
NEW_TOKENS = 32  # decoding: the time from the first new token to the last of 1 + NEW_TOKENS, per token
SETTING = {
    "attn": "full-coverage",
    "pos": "interleave",
    "ratios": [RATIO],
    "sink": 0,
    "params": ["q", "k", "v"],
    "window": WINDOW,
    "positions": POSITIONS,
}


def measure(run, repeats: int, grad: bool) -> dict:
    """Median seconds of ``run()`` over ``repeats`` calls after a warm-up, and its peak tensor memory (bytes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def call():
        with torch.set_grad_enabled(grad):
            run()

    call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    held = peak = 0  # allocations are attributed to the op that made them, frees to "[memory]" events
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return {"seconds": statistics.median(seconds), "peak_bytes": peak}


def freeze_all_but_beacons(model, trainable_names) -> None:
    """Only the named (beacon) parameters train, on both sides alike."""
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trainable_names)


def run_both(model, input_ids, repeats: int, reset=None, keep_last_logits: bool = False) -> dict:
    """Prefill, training-step and decoding measurements of one side (``reset()`` before each call clears the
    authors' memory; ours keeps none between calls)."""
    import torch

    reset = reset or (lambda: None)

    def prefill():
        reset()
        model.eval()
        return model(input_ids=input_ids, **({"logits_to_keep": 1} if keep_last_logits else {}))

    def train_step():
        reset()
        model.train()
        model.zero_grad(set_to_none=True)
        model(input_ids=input_ids, labels=input_ids).loss.backward()

    def decode_seconds_per_token() -> float:
        """Greedy ``generate`` after the prompt; the time between the first and the last new token's scores, per
        token (the prefill is outside it)."""
        stamps = []

        def stamp(_ids, scores):  # a logits processor: called once per new token, after its forward
            stamps.append(time.perf_counter())
            return scores

        reset()
        model.eval()
        with torch.no_grad():
            model.generate(
                input_ids,
                max_new_tokens=1 + NEW_TOKENS,
                min_new_tokens=1 + NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
                logits_processor=[stamp],
            )
        return (stamps[-1] - stamps[0]) / NEW_TOKENS

    decode_seconds_per_token()  # warm-up
    per_token = statistics.median(decode_seconds_per_token() for _ in range(repeats))
    return {
        "prefill": measure(prefill, repeats, grad=False),
        "training step": measure(train_step, repeats, grad=True),
        "decode per token": {"seconds": per_token},
    }


def authors_side(src: Path, out: Path, repeats: int, threads: int) -> None:
    """Under transformers 4.39: the authors' model on the saved input; writes ``out/authors-bench.json``."""
    import torch

    torch.set_num_threads(threads)
    model = build_authors_model(src, SETTING, out, shape=SHAPE)
    trainable = {name for name, _ in model.named_parameters() if "beacon_" in name}
    freeze_all_but_beacons(model, trainable)
    input_ids = torch.load(out / "input_ids.pt")
    results = run_both(model, input_ids, repeats, reset=model.memory.reset)
    (out / "authors-bench.json").write_text(json.dumps(results))


def our_side(out: Path, repeats: int, threads: int, parallel_windows: int) -> dict:
    """longpeft: the converted checkpoint on the same input, measured as the authors' side was, its prefill running
    ``parallel_windows`` windows per forward (the authors' side: one)."""
    import torch

    from longpeft.adapters.beacon import set_inference_settings, trainable_beacon_parameters

    torch.set_num_threads(threads)
    model = load_converted(out, POSITIONS, shape=SHAPE)
    set_inference_settings(model, parallel_windows=parallel_windows)
    trainable = {f"model.{name}" for name in trainable_beacon_parameters(model)}
    freeze_all_but_beacons(model, trainable)
    return run_both(model, torch.load(out / "input_ids.pt"), repeats, keep_last_logits=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_authors_arguments(parser)
    parser.add_argument("--windows", type=int, default=32, help="input length in windows of 128 tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads on both sides")
    parser.add_argument(
        "--parallel-windows",
        type=int,
        default=1,
        help="windows per forward in our prefill (default 1: like the authors' side, one at a time)",
    )
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    status = authors_side_or_error(
        args, lambda: authors_side(args.authors_src.resolve(), args.out, args.repeats, args.threads)
    )
    if status is not None:
        return status
    import torch

    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        torch.manual_seed(0)
        torch.save(torch.randint(3, SHAPE["vocab_size"], (1, WINDOW * args.windows)), out / "input_ids.pt")
        if not run_authors_side(__file__, args, out, "--repeats", str(args.repeats), "--threads", str(args.threads)):
            return 1
        theirs = json.loads((out / "authors-bench.json").read_text())
        ours = our_side(out, args.repeats, args.threads, args.parallel_windows)
    print(
        f"{WINDOW * args.windows} tokens ({args.windows} windows of {WINDOW}, ratio {RATIO}), "
        f"{args.threads} thread(s), our prefill {args.parallel_windows} window(s) per forward"
    )
    print(
        f"{'':<16} {'ours s':>9} {'authors s':>10} {'time ratio':>11} {'ours MiB':>9} {'authors MiB':>12} "
        f"{'memory ratio':>13}"
    )
    ratios = {}
    for task in ("prefill", "training step", "decode per token"):
        o, a = ours[task], theirs[task]
        key = task.replace(" ", "_")
        ratios[f"{key}_time_ratio"] = o["seconds"] / a["seconds"]
        line = f"{task:<16} {o['seconds']:>9.3f} {a['seconds']:>10.3f} {ratios[f'{key}_time_ratio']:>11.2f}"
        if "peak_bytes" in o:
            ratios[f"{key}_peak_mem_ratio"] = o["peak_bytes"] / a["peak_bytes"]
            line += (
                f" {o['peak_bytes'] / 2**20:>9.1f} {a['peak_bytes'] / 2**20:>12.1f} "
                f"{ratios[f'{key}_peak_mem_ratio']:>13.2f}"
            )
        print(line)
    print(
        json.dumps(
            {
                "bench": "beacon_authors",
                "tokens": WINDOW * args.windows,
                "threads": args.threads,
                "parallel_windows": args.parallel_windows,
                "ours": ours,
                "authors": theirs,
                **ratios,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
