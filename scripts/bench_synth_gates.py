"""Precision and recall of the synth quality gates on a labelled set of model outputs.

Each output of the labelled set (tests/data/synth_gates_labelled.json: QA items written in the style of a weak local
model and of a GPT-4-class one, and two rows a llama.cpp server wrote, each item labelled good or bad) is served,
with its finish_reason, by the local stub server and goes through the run's own path: the LLM answerer's request,
the client (an answer cut off at max_tokens is a truncated attempt), the parser and the quality gates with their
default thresholds, one attempt per output. An item is rejected when it is not among the items the answerer kept;
its reason is the one in rejects.jsonl.

- precision: of the rejected items, the share labelled bad; recall: of the bad items, the share rejected;
  good kept: of the good items, the share kept (1 - the false rejections);
- per gate: its rejections and the share of them that were bad items;
- per kind of item: how many the gates rejected (bad kinds) or kept (good kinds).

Prints the tables, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from longpeft.synth_data.corpus import Document  # noqa: E402
from longpeft.synth_data.llm_client import LLMClient, LLMConfig  # noqa: E402
from longpeft.synth_data.qa import LLMAnswerer, Passage, QAJob  # noqa: E402
from longpeft.synth_data.quality import REASONS, QualityConfig, QualityGates  # noqa: E402

from stub_server import StubServer  # noqa: E402  (tests/stub_server.py)

LABELLED = ROOT / "tests" / "data" / "synth_gates_labelled.json"
KEY_ENV = "LONGPEFT_BENCH_SYNTH_GATES_KEY"


def judge_output(
    server: StubServer, output: dict[str, Any], contexts: dict[str, str], folder: Path, gates: QualityConfig
) -> list[str]:
    """The fate of each item of ``output`` through the run's path: ``kept``, or the reason it was rejected."""
    items = output["items"]
    text = contexts[output["context"]]
    title = text.split("\n", 1)[0]
    job = QAJob(output["task"], [Passage(Document(output["context"], title, text), 0, len(text))], len(items))
    answer = {"qa_pairs": [{"question": i["question"], "answer": i["answer"]} for i in items]}
    server.reply = lambda body: (json.dumps(answer), output["finish_reason"])
    config = LLMConfig(base_url=server.base_url, model="stub", api_key_env=KEY_ENV, max_parse_attempts=1)
    client = LLMClient(config, folder / "cache", folder / "rejects.jsonl", show_progress=False)
    [kept] = LLMAnswerer(client, QualityGates(gates)).generate([job])
    fates = {(p.question, p.answer): "kept" for p in kept or []}
    for record in client.rejects.records():
        if record["kind"] == "item":
            fates[(record["question"], record["answer"])] = record["reason"]
        elif record["reason"] != "quality":  # the whole answer is lost: truncated, malformed, ...
            fates = {(i["question"], i["answer"]): record["reason"] for i in items}
    return [fates[(i["question"], i["answer"])] for i in items]


def rates(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts and rates of ``rows`` (items with ``label`` and ``fate``)."""
    bad = [r for r in rows if r["label"] == "bad"]
    good = [r for r in rows if r["label"] == "good"]
    rejected_bad = sum(r["fate"] != "kept" for r in bad)
    rejected_good = sum(r["fate"] != "kept" for r in good)
    rejected = rejected_bad + rejected_good
    return {
        "items": len(rows),
        "bad": len(bad),
        "good": len(good),
        "rejected": rejected,
        "precision": round(rejected_bad / rejected, 3) if rejected else None,
        "recall": round(rejected_bad / len(bad), 3) if bad else None,
        "good_kept": round(1 - rejected_good / len(good), 3) if good else None,
    }


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(LABELLED), help="the labelled set (JSON)")
    parser.add_argument("--show", action="store_true", help="also list every item the gates got wrong")
    parser.add_argument(
        "--disable",
        nargs="+",
        default=[],
        choices=REASONS,
        metavar="GATE",
        help="gates to switch off (quality.disable)",
    )
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    gates = QualityConfig(disable=args.disable)
    data = json.loads(Path(args.data).read_text(encoding="utf-8"))
    os.environ.setdefault(KEY_ENV, "local")
    rows = []
    with StubServer() as server, tempfile.TemporaryDirectory() as tmp:
        for number, output in enumerate(data["outputs"]):
            fates = judge_output(server, output, data["contexts"], Path(tmp) / str(number), gates)
            for item, fate in zip(output["items"], fates):
                rows.append({**item, "fate": fate, **{k: output[k] for k in ("id", "model", "split", "task")}})

    off = f"; off: {', '.join(args.disable)}" if args.disable else ""
    print(f"Quality gates on {len(rows)} labelled items ({Path(args.data).name}{off})\n")
    print(f"{'items':<22} {'n':>4} {'bad':>4} {'rejected':>9} {'precision':>10} {'recall':>7} {'good kept':>10}")
    groups = {"all": rows}
    for key in ("split", "model"):
        for value in sorted({r[key] for r in rows}):
            groups[f"{key} {value}"] = [r for r in rows if r[key] == value]
    summary = {name: rates(group) for name, group in groups.items()}
    for name, r in summary.items():
        print(
            f"{name:<22} {r['items']:>4} {r['bad']:>4} {r['rejected']:>9} {percent(r['precision']):>10} "
            f"{percent(r['recall']):>7} {percent(r['good_kept']):>10}"
        )

    print(f"\n{'gate (reason)':<22} {'rejected':>9} {'of them bad':>12} {'precision':>10}")
    by_gate: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["fate"] != "kept":
            by_gate[r["fate"]].append(r)
    for gate, group in sorted(by_gate.items(), key=lambda kv: -len(kv[1])):
        bad = sum(r["label"] == "bad" for r in group)
        print(f"{gate:<22} {len(group):>9} {bad:>12} {percent(bad / len(group)):>10}")

    print(f"\n{'kind of item':<22} {'label':<6} {'n':>4} {'rejected':>9} {'kept':>5}   reasons")
    kinds: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        kinds[(r["label"], r["kind"])].append(r)
    for (label, kind), group in sorted(kinds.items()):
        reasons = Counter(r["fate"] for r in group if r["fate"] != "kept")
        rejected = sum(reasons.values())
        shown = ", ".join(f"{reason} {n}" for reason, n in reasons.most_common())
        print(f"{kind:<22} {label:<6} {len(group):>4} {rejected:>9} {len(group) - rejected:>5}   {shown}")

    if args.show:
        print("\nwrong:")
        for r in rows:
            if (r["fate"] == "kept") == (r["label"] == "bad"):
                print(f"  [{r['label']} {r['kind']}, {r['fate']}] Q {r['question']!r} A {r['answer']!r}")
    result = {"bench": "synth_gates", "disabled": args.disable, **summary["all"]}
    for split in sorted({r["split"] for r in rows}):
        result[split] = summary[f"split {split}"]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
