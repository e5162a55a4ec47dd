"""Run HARPE's peak-valley search at the paper's setting and print it beside the paper's Table 2.

Setting (HARPE paper, Sec. 4.2): Llama-2-7B (32 heads, head_dim 128), b_min = 1M, b_max = 5M,
stride 30k, 128K target length. The paper's bases below were read by hand from its Table 2 and are
printed for comparison only; the library never uses them.

    python scripts/repro_harpe_table2.py [--window-fraction 0.015625]
"""

from __future__ import annotations

import argparse
import json

from longpeft.adapters.harpe.selection import DEFAULT_WINDOW_FRACTION, peak_valley_bases

# Table 2 of the HARPE paper, heads 1..32, in millions (comparison only).
PAPER_TABLE2_MILLIONS = [
    1.00, 1.15, 1.30, 1.45, 2.17, 2.20, 2.23, 2.47, 2.50, 2.65, 2.68, 2.71, 2.74, 2.80, 2.83, 2.92,
    3.01, 3.04, 3.10, 3.13, 3.16, 3.22, 3.43, 3.46, 3.61, 3.88, 4.09, 4.15, 4.39, 4.45, 4.51, 4.54,
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window-fraction", type=float, default=DEFAULT_WINDOW_FRACTION,
                        help="peak/valley window half-width as a fraction of the target length")
    parser.add_argument("--target-length", type=int, default=131072)
    args = parser.parse_args()

    ours = peak_valley_bases(1e6, 5e6, 32, 30_000, 128, args.target_length, window_fraction=args.window_fraction)
    ours_millions = [round(b / 1e6, 2) for b in ours]
    paper = PAPER_TABLE2_MILLIONS
    print(f"\n{'head':>4}{'ours (M)':>10}{'paper (M)':>11}{'diff':>8}")
    for head, (mine, theirs) in enumerate(zip(ours_millions, paper), start=1):
        print(f"{head:>4}{mine:>10.2f}{theirs:>11.2f}{mine - theirs:>+8.2f}")
    shared = sorted(set(ours_millions) & set(paper))
    mean_abs = sum(abs(a - b) for a, b in zip(ours_millions, paper)) / len(paper)
    # How many shared values two random 31-of-133 grid picks would have on average (b_min is in both).
    chance = 1 + 31 * 31 / 133
    print(f"\nshared values: {len(shared)} of 32 (random picks share ~{chance:.1f}); "
          f"mean |ours - paper| per head: {mean_abs:.3f}M")
    print(json.dumps({
        "repro": "harpe_table2",
        "window_fraction": args.window_fraction,
        "target_length": args.target_length,
        "ours_millions": ours_millions,
        "shared_with_paper": len(shared),
        "mean_abs_diff_millions": round(mean_abs, 3),
    }))


if __name__ == "__main__":
    main()
