"""Benchmark: STRING's forward time and peak memory as ratios of the unpatched model, same length.

A small Llama-shaped model (hidden 512, 8 query / 2 KV heads of 64 dims, MLP 1376, 2 layers)
whose trained length equals the benchmark length, so STRING uses the paper's defaults S = L/3,
W = 128. At 4K tokens attention is about 40% of this model's forward FLOPs (more than in an 8B
model at 4K, less than at 32K+), so the attention kernel alone is also timed and reported.
Both variants run in one process, alternating, on the same inputs; time is the median of the
repeats; peak memory is the largest amount of tensor memory held during one forward beyond what
was held before it (CPU: reconstructed from torch.profiler's allocation events; CUDA:
torch.cuda.max_memory_allocated).

    .venv/bin/python scripts/bench_string.py [--seq-len 4096] [--attn sdpa|eager|flash_attention_2]
        [--device cpu] [--threads 1]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import eager_attention_forward

from longpeft.adapters.string import (
    disable_string,
    enable_string,
    string_attention_eager,
    string_attention_flash,
    string_attention_sdpa,
)
from longpeft.rope import inv_freq
from longpeft.tiny import tiny_model

from benchlib import peak_bytes, timed  # scripts/benchlib.py


def build_model(seq_len: int, attn: str, device: str, dtype: torch.dtype):
    model = tiny_model(
        "llama",
        hidden_size=512,
        intermediate_size=1376,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=seq_len,
        attn_implementation=attn,
    )
    return model.to(device=device, dtype=dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager", "flash_attention_2"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1 gives steadier ratios on a shared machine)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.attn == "flash_attention_2" else torch.float32
    torch.manual_seed(0)
    model = build_model(args.seq_len, args.attn, args.device, dtype)
    input_ids = torch.randint(7, 512, (1, args.seq_len), device=args.device)

    settings = enable_string(model)
    shift, window = settings["shift"], settings["local_window"]
    config = model.config
    q = torch.randn(1, config.num_attention_heads, args.seq_len, config.head_dim, device=args.device, dtype=dtype)
    k, v = (
        torch.randn(1, config.num_key_value_heads, args.seq_len, config.head_dim, device=args.device, dtype=dtype)
        for _ in "kv"
    )
    freqs = inv_freq(10000.0, config.head_dim, args.device)
    scale = config.head_dim**-0.5
    if args.attn == "eager":  # explicit scores, as transformers' eager attention
        groups = SimpleNamespace(
            num_key_value_groups=config.num_attention_heads // config.num_key_value_heads, training=False
        )
        future = torch.ones(args.seq_len, args.seq_len, dtype=torch.bool, device=args.device).triu(1)
        mask = torch.zeros(1, 1, args.seq_len, args.seq_len, dtype=dtype, device=args.device).masked_fill(
            future, torch.finfo(dtype).min
        )
        attention = {
            "rope": lambda: eager_attention_forward(groups, q, k, v, mask, scaling=scale),
            "string": lambda: string_attention_eager(q, k, v, mask, shift, window, freqs, scale),
        }
    else:  # the SDPA kernel (the flash-attn path is timed on a GPU with --attn flash_attention_2 --device cuda)
        attention = {
            "rope": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
            "string": lambda: string_attention_sdpa(q, k, v, None, shift, window, freqs, scale),
        }
        if args.attn == "flash_attention_2":
            from flash_attn import flash_attn_func

            qf, kf, vf = (x.transpose(1, 2).contiguous() for x in (q, k, v))
            attention = {
                "rope": lambda: flash_attn_func(qf, kf, vf, softmax_scale=scale, causal=True),
                "string": lambda: string_attention_flash(q, k, v, shift, window, freqs, scale),
            }

    def forward(variant: str):
        if variant == "string":
            enable_string(model, **settings)
        else:
            disable_string(model)
        return lambda: model(input_ids, use_cache=False)

    times = {f"{part}_{variant}": [] for part in ("model", "attn") for variant in ("rope", "string")}
    for variant in ("rope", "string"):  # warm-up
        timed(forward(variant))
        timed(attention[variant])
    for _ in range(args.repeats):
        for variant in ("rope", "string"):
            times[f"model_{variant}"].append(timed(forward(variant)))
            times[f"attn_{variant}"].append(timed(attention[variant]))
    cuda = args.device.startswith("cuda")
    peak = {}
    for variant in ("rope", "string"):
        peak[f"model_{variant}"] = peak_bytes(forward(variant), cuda)
        peak[f"attn_{variant}"] = peak_bytes(attention[variant], cuda)
    disable_string(model)

    median = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"STRING vs RoPE, seq_len={args.seq_len}, attn={args.attn}, device={args.device}, "
        f"threads={torch.get_num_threads()}, S={shift}, W={window}, median of {args.repeats}"
    )
    print(
        f"{'what':<22} {'rope s':>9} {'string s':>9} {'time ratio':>10} {'rope MiB':>9} {'string MiB':>10} "
        f"{'mem ratio':>9}"
    )
    for part, label in (("model", "whole model forward"), ("attn", "attention kernel only")):
        t_r, t_s = median[f"{part}_rope"], median[f"{part}_string"]
        m_r, m_s = peak[f"{part}_rope"], peak[f"{part}_string"]
        print(
            f"{label:<22} {t_r:>9.4f} {t_s:>9.4f} {t_s / t_r:>10.3f} {m_r / 2**20:>9.1f} {m_s / 2**20:>10.1f} "
            f"{m_s / m_r:>9.3f}"
        )
    result = {
        "bench": "string",
        "seq_len": args.seq_len,
        "attn": args.attn,
        "device": args.device,
        "shift": shift,
        "local_window": window,
        "time_ratio": round(median["model_string"] / median["model_rope"], 3),
        "peak_mem_ratio": round(peak["model_string"] / peak["model_rope"], 3),
        "attn_time_ratio": round(median["attn_string"] / median["attn_rope"], 3),
        "attn_peak_mem_ratio": round(peak["attn_string"] / peak["attn_rope"], 3),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
