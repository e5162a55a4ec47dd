"""Benchmark of the synthetic-data tools, as ratios measured in one run on this machine.

1. UtK transform cost relative to tokenizing the same text (target < 0.05): the augmentation runs on
   token ids on the fly, so it must be cheap next to the tokenisation every pipeline already pays.
2. Request throughput of the QA builder's LLM path (prompt building, client, parsing) against a
   local OpenAI-compatible server with a fixed latency, at concurrency 1, 4 and 16, relative to
   perfect linear scaling of the concurrency-1 rate (target >= 0.8).

Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longpeft.synth_data.corpus import corpus_texts, generate_document  # noqa: E402
from longpeft.synth_data.llm_client import LLMClient, LLMConfig  # noqa: E402
from longpeft.synth_data.qa import LLMAnswerer, Passage, QAJob  # noqa: E402
from longpeft.synth_data.utk import UtkAugmenter, add_utk_tokens  # noqa: E402
from longpeft.tiny import demo_tokenizer  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_utk(n_docs: int, repeats: int) -> dict:
    tokenizer = demo_tokenizer()
    tokens = add_utk_tokens(tokenizer, max_chunks=3)
    texts = corpus_texts(n=n_docs, seed=1, n_sentences=200)
    documents = [np.asarray(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    augmenter = UtkAugmenter(tokens, probability=1.0, chunk_counts={2: 0.5, 3: 0.5}, seed=0)
    tokenize = median_seconds(lambda: tokenizer(texts, add_special_tokens=False), repeats)
    utk = median_seconds(lambda: augmenter(documents), repeats)
    return {
        "utk_tokens": int(sum(len(d) for d in documents)),
        "tokenize_s": tokenize,
        "utk_s": utk,
        "utk_time_ratio": utk / tokenize,
    }


def bench_throughput(latency: float, per_worker: int, concurrencies: list[int]) -> dict:
    """Requests per second of LLMAnswerer.generate at each concurrency, against a stub in another process
    (so the server's threads do not compete with the client for this process's GIL)."""
    os.environ.setdefault("LONGPEFT_BENCH_KEY", "bench")
    document = generate_document(seed=0, n_sentences=400)
    root = Path(__file__).resolve().parents[1]
    server = subprocess.Popen(
        [sys.executable, str(root / "tests" / "stub_server.py"), "--latency", str(latency)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
    )
    rates = {}
    try:
        base_url = server.stdout.readline().strip()
        with tempfile.TemporaryDirectory() as tmp:
            for run, concurrency in enumerate([concurrencies[0], *concurrencies]):  # the first run warms up
                n = per_worker * concurrency
                step = len(document.text) // n
                jobs = [QAJob("single_detail", [Passage(document, i * step, (i + 1) * step)], 3) for i in range(n)]
                config = LLMConfig(
                    base_url=base_url, model="stub", api_key_env="LONGPEFT_BENCH_KEY", max_concurrency=concurrency
                )
                client = LLMClient(
                    config, Path(tmp) / f"cache-{run}", Path(tmp) / "rejects.jsonl", show_progress=False
                )
                start = time.perf_counter()
                results = LLMAnswerer(client).generate(jobs)
                elapsed = time.perf_counter() - start
                assert all(r is not None for r in results), "the stub should answer every request"
                if run:
                    rates[concurrency] = n / elapsed
    finally:
        server.terminate()
        server.wait()
    base = rates[concurrencies[0]]
    return {
        "latency_s": latency,
        "requests_per_s": {str(c): round(r, 2) for c, r in rates.items()},
        "linear_efficiency": {str(c): round(r / (base * c / concurrencies[0]), 3) for c, r in rates.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=40, help="documents in the UtK sequence")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--latency", type=float, default=0.5, help="stub server latency per request (s); real LLM calls take seconds"
    )
    parser.add_argument("--per-worker", type=int, default=6, help="requests per unit of concurrency")
    args = parser.parse_args()

    utk = bench_utk(args.docs, args.repeats)
    throughput = bench_throughput(args.latency, args.per_worker, [1, 4, 16])
    efficiency = throughput["linear_efficiency"]

    print(
        f"UtK on {utk['utk_tokens']} tokens: {utk['utk_s'] * 1e3:.1f} ms vs tokenizing "
        f"{utk['tokenize_s'] * 1e3:.1f} ms -> ratio {utk['utk_time_ratio']:.4f} (target < 0.05)"
    )
    print(f"LLM builder throughput, stub latency {args.latency * 1e3:.0f} ms:")
    print(f"  {'concurrency':>11} {'req/s':>8} {'vs linear':>10}")
    for c, rate in throughput["requests_per_s"].items():
        print(f"  {c:>11} {rate:>8.2f} {efficiency[c]:>10.3f}")
    result = {
        "bench": "synth",
        "utk_tokens": utk["utk_tokens"],
        "utk_time_ratio": round(utk["utk_time_ratio"], 5),
        "requests_per_s": throughput["requests_per_s"],
        "linear_efficiency": efficiency,
        "utk_target_met": utk["utk_time_ratio"] < 0.05,
        "throughput_target_met": min(efficiency.values()) >= 0.8,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
