"""Chunked (fused) LM-head loss vs full logits: peak memory and time of one forward + backward.

The 80K recipe cannot afford full logits (80K tokens x 128K vocab x fp32 = ~39 GiB, twice with the
gradient). longpeft trains through TRL's fused LM head, which scores the labels in tiles. This bench
runs one training forward+backward of a small Llama with the Llama-3 vocabulary both ways, each in
a fresh process, and reports the extra resident memory over the loaded model and the time. A third
run, the backbone alone (no LM head), separates what the loss path itself costs from the
activations every path shares: ``peak_mem_ratio`` compares the loss paths' own memory.

    python scripts/bench_loss.py [--seq-len 4096] [--vocab 128256]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def worker(variant: str, seq_len: int, vocab: int) -> dict:
    import torch
    from trl.trainer.utils import add_fused_lm_head

    from longpeft.tiny import tiny_model

    torch.manual_seed(0)
    model = tiny_model(
        "llama",
        vocab_size=vocab,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        max_position_embeddings=seq_len,
        attn_implementation="sdpa",
    ).train()
    ids = torch.randint(0, vocab, (1, seq_len))
    if variant == "fused":
        add_fused_lm_head(model)
    loaded_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    if variant == "backbone":
        loss = model.model(input_ids=ids).last_hidden_state.float().pow(2).mean()
    elif variant == "full":
        logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    else:
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        loss = -out.log_probs.sum() / out.label_mask.sum()
    loss.backward()
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": variant, "loss": loss.item(), "seconds": seconds, "extra_mib": (peak_kib - loaded_kib) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--worker", choices=["backbone", "full", "fused"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.seq_len, args.vocab)))
        return
    results = {}
    for variant in ("backbone", "full", "fused"):
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                "--worker",
                variant,
                "--seq-len",
                str(args.seq_len),
                "--vocab",
                str(args.vocab),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    backbone, full, fused = results["backbone"], results["full"], results["fused"]
    full_own = full["extra_mib"] - backbone["extra_mib"]
    fused_own = fused["extra_mib"] - backbone["extra_mib"]
    logits_gib = args.seq_len * args.vocab * 4 / 2**30
    print(f"one forward+backward, seq {args.seq_len}, vocab {args.vocab} (fp32 logits alone: {logits_gib:.2f} GiB)")
    print(f"{'loss path':<14}{'loss':>10}{'seconds':>10}{'extra MiB':>12}{'own MiB':>10}")
    for r in (backbone, full, fused):
        own = r["extra_mib"] - backbone["extra_mib"]
        print(f"{r['variant']:<14}{r['loss']:>10.5f}{r['seconds']:>10.2f}{r['extra_mib']:>12.0f}{own:>10.0f}")
    print(
        json.dumps(
            {
                "bench": "loss",
                "seq_len": args.seq_len,
                "vocab": args.vocab,
                "time_ratio": round(fused["seconds"] / full["seconds"], 3),
                "peak_mem_ratio": round(fused_own / full_own, 3),
                "total_peak_mem_ratio": round(fused["extra_mib"] / full["extra_mib"], 3),
                "loss_abs_diff": abs(fused["loss"] - full["loss"]),
            }
        )
    )


if __name__ == "__main__":
    main()
