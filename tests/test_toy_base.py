"""The packaged toy base (longpeft:toy-base), the retrieval documents it was trained on, the
`data.source: retrieval` recipe source, and the demo's before/after table (built from eval JSON)."""

from __future__ import annotations

import json
import warnings

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from longpeft.base_config import BUILTIN_MODELS, TOY_BASE, model_location
from longpeft.eval import evaluate
from longpeft.eval.demo_report import (
    DEMO_TASKS,
    SETTINGS,
    before_after_table,
    collect_rows,
    run_demo_evals,
    setting_folder,
)
from longpeft.synth_data.retrieval_docs import RetrievalDocuments, build_retrieval_dataset

TOY = BUILTIN_MODELS[TOY_BASE]


@pytest.fixture(scope="module")
def toy():
    return AutoModelForCausalLM.from_pretrained(model_location(TOY_BASE)).eval(), AutoTokenizer.from_pretrained(TOY)


def test_shipped_toy_base_retrieves_inside_its_window(toy):
    model, tokenizer = toy
    window = model.config.max_position_embeddings
    assert window == 256 and model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    for task in ("passkey", "niah_single"):
        result = evaluate(
            task,
            model,
            tokenizer,
            lengths=[window],
            depths=(0.0, 0.5, 1.0),
            n_samples=2,
            seed=99,
            chat=False,
            batch_size=6,
        )
        assert result["score"] >= 0.8, (task, result["score"])


def test_shipped_toy_base_fails_beyond_its_window(toy):
    model, tokenizer = toy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the beyond-positions warning is the point here
        result = evaluate(
            "passkey",
            model,
            tokenizer,
            lengths=[1024],
            depths=(0.0, 0.5, 1.0),
            n_samples=2,
            seed=99,
            chat=False,
            batch_size=6,
        )
    assert result["score"] <= 0.2


def test_toy_base_card_states_how_it_was_made_and_its_scores():
    card = (TOY / "README.md").read_text()
    scores = json.loads((TOY / "scores.json").read_text())
    assert "scripts/pretrain_toy_base.py" in card and f"--steps {scores['steps']}" in card
    for task, by_length in scores["scores"].items():
        row = next(line for line in card.splitlines() if line.startswith(f"| {task} |"))
        assert row == f"| {task} | " + " | ".join(f"{by_length[n]:.2f}" for n in sorted(by_length, key=int)) + " |"


@pytest.mark.parametrize("kind", ["passkey", "niah", "induction"])
def test_retrieval_documents_have_exact_lengths_and_answers_found_earlier(tokenizer, kind):
    docs = RetrievalDocuments(tokenizer, seed=3)
    for n in (200, 256, 301):
        ids = docs.document(n, kind)
        assert len(ids) == n
        if kind != "induction":
            text = tokenizer.decode(ids)
            answer = text.rstrip(".").split()[-1]
            assert answer.isdigit() and text[: text.rindex(answer)].count(answer) >= 1  # stated before it is asked for


def test_induction_documents_repeat_spans(tokenizer):
    ids = RetrievalDocuments(tokenizer, seed=0).induction(400)
    trigrams = [tuple(ids[i : i + 3]) for i in range(len(ids) - 2)]
    assert len(set(trigrams)) < 0.8 * len(trigrams)  # recurring spans: many trigrams come back


def test_retrieval_documents_are_deterministic_and_validated(tokenizer):
    a = RetrievalDocuments(tokenizer, seed=5).documents(6, [128, 256])
    b = RetrievalDocuments(tokenizer, seed=5).documents(6, [128, 256])
    c = RetrievalDocuments(tokenizer, seed=6).documents(6, [128, 256])
    assert a == b and a != c
    with pytest.raises(ValueError, match="mix maps kinds"):
        RetrievalDocuments(tokenizer, mix={"essay": 1.0})
    with pytest.raises(ValueError, match="cannot build a niah document of 40 tokens"):
        RetrievalDocuments(tokenizer).document(40, "niah")
    assert len(RetrievalDocuments(tokenizer).document(40)) == 40  # a drawn probe that cannot fit -> induction


def test_retrieval_dataset_round_trips_through_text(tokenizer):
    dataset = build_retrieval_dataset(tokenizer, n_documents=4, min_tokens=150, max_tokens=200, seed=1)
    lengths = [len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in dataset["text"]]
    assert all(150 <= n <= 200 for n in lengths)


def test_recipe_source_retrieval_is_checked():
    from longpeft.recipes.schema import RecipeError, load_recipe

    recipe = load_recipe("toy-extend-cpu")
    assert recipe.data.source == "retrieval" and recipe.model.name_or_path == TOY_BASE
    with pytest.raises(RecipeError, match="retrieval is plain text"):
        load_recipe("toy-extend-cpu", ["data.format=messages"])
    with pytest.raises(RecipeError, match="min_tokens must be <= max_tokens"):
        load_recipe("toy-extend-cpu", ["data.retrieval.min_tokens=2000"])
    with pytest.raises(RecipeError, match="data.retrieval configures"):
        load_recipe("toy-extend-cpu", ["data.source=train.jsonl"])


def test_builtin_model_names_resolve_to_packaged_folders(tmp_path):
    assert model_location(TOY_BASE) == str(TOY) and (TOY / "model.safetensors").is_file()
    assert model_location("owner/name") == "owner/name" and model_location(tmp_path) == str(tmp_path)


def test_before_after_table_is_built_from_eval_json(tmp_path):
    # Distinct made-up scores per cell: the table must show exactly what the JSON files say.
    for k, setting in enumerate(SETTINGS):
        for j, task in enumerate(DEMO_TASKS):
            folder = tmp_path / setting_folder(setting)
            folder.mkdir(exist_ok=True)
            by_length = {str(n): round(0.01 * (k * 40 + j * 10 + m), 2) for m, n in enumerate((64, 128, 256))}
            (folder / f"{task}.json").write_text(json.dumps({"task": task, "by_length": by_length}))
    rows = collect_rows(tmp_path)
    assert len(rows) == len(SETTINGS) * len(DEMO_TASKS) * 3
    table = before_after_table(rows, window=64).splitlines()
    assert table[0] == "| setting (W = 64) | passkey 1W | passkey 2W | passkey 4W | NIAH 1W | NIAH 2W | NIAH 4W |"
    assert table[4] == "| adapter | 0.80 | 0.81 | 0.82 | 0.90 | 0.91 | 0.92 |"
    (tmp_path / "base" / "passkey.json").unlink()
    with pytest.raises(FileNotFoundError, match="no eval result for base / passkey"):
        collect_rows(tmp_path)


def test_demo_evals_write_every_setting(tmp_path, tokenizer):
    from peft import LoraConfig, get_peft_model

    from longpeft.spec import ContextSpec
    from longpeft.tiny import tiny_model

    model = tiny_model("llama", vocab_size=len(tokenizer), attn_implementation="sdpa")
    model.save_pretrained(tmp_path / "base")
    adapter_dir = tmp_path / "adapter"
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(adapter_dir)
    tokenizer.save_pretrained(adapter_dir)
    ContextSpec.from_base(model.config, "rope", base_model=str(tmp_path / "base"), trained_length=256).save(
        adapter_dir
    )
    window = run_demo_evals(tmp_path, adapter_dir, n_samples=1, lengths=(256,))
    assert window == 256
    rows = collect_rows(tmp_path / "eval")
    assert {r["setting"] for r in rows} == set(SETTINGS) and all(0.0 <= r["score"] <= 1.0 for r in rows)
    assert (tmp_path / "eval" / "adapter_STRING" / "niah_single_heatmap.png").exists()
    saved = json.loads((tmp_path / "eval" / "base_STRING" / "passkey.json").read_text())
    assert saved["string"]["shift"] == 256 // 3
