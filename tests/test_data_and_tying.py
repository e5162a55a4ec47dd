"""Training data tokenized once with assistant masks from any chat template (no {% generation %}
markers needed), and trained embeddings on tied and untied bases through train -> load -> merge ->
plain from_pretrained."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import longpeft
from longpeft import hub
from longpeft.adapters import apply_spec
from longpeft.recipes.data import tokenize_conversation
from longpeft.recipes.peft_setup import lora_config
from longpeft.recipes.runner import prepare, run
from longpeft.recipes.schema import load_recipe
from longpeft.tiny import sample_text, tiny_model, train_tokenizer

LLAMA3_TEMPLATE = (  # Llama-3-Instruct's template (no generation markers)
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (  # ChatML (Qwen, SmolLM): no generation markers
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# (template, special tokens, what each assistant turn contributes to the loss after its content)
TEMPLATES = {
    "llama3": (LLAMA3_TEMPLATE, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"], "<|eot_id|>"),
    "chatml": (CHATML_TEMPLATE, ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
}
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "The pass key is 60494. What is the pass key?"},
    {"role": "assistant", "content": "The pass key is 60494."},
    {"role": "user", "content": "And twice that?"},
    {"role": "assistant", "content": "It is 120988."},
]


def marker_free_tokenizer(name: str):
    template, specials, _ = TEMPLATES[name]
    tokenizer = train_tokenizer(sample_text())
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_assistant_masks_from_a_template_without_generation_markers(name):
    tokenizer = marker_free_tokenizer(name)
    assert "{% generation %}" not in tokenizer.chat_template
    row = tokenize_conversation(tokenizer, CONVERSATION, assistant_only=True)
    masked = [i for i, m in zip(row["input_ids"], row["assistant_masks"], strict=True) if m]
    # Independent reference: what the loss must see, built from the messages and the template's turn end.
    end = TEMPLATES[name][2]
    expected = "".join(turn["content"] + end for turn in CONVERSATION if turn["role"] == "assistant")
    assert tokenizer.decode(masked) == expected
    full = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(row["input_ids"]) == full  # tokenized once, nothing added or lost


@pytest.mark.parametrize("name", [*sorted(TEMPLATES), "chatml+default-system"])
def test_a_conversation_that_opens_with_the_assistant_scores_only_its_turns(name):
    """The first turn's prompt is what comes before the assistant's turn (BOS, the role header, a template's
    default system prompt), never taken as empty, which would score it with the answer."""
    tokenizer = marker_free_tokenizer(name.split("+")[0])
    if name.endswith("default-system"):  # Qwen2.5's: a system turn is added when the conversation has none
        tokenizer.chat_template = (
            "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful "
            "assistant.<|im_end|>\n{% endif %}" + CHATML_TEMPLATE
        )
    conversation = [{"role": "assistant", "content": "Hello, how can I help?"}, *CONVERSATION[1:3]]
    row = tokenize_conversation(tokenizer, conversation, assistant_only=True)
    masked = [i for i, m in zip(row["input_ids"], row["assistant_masks"], strict=True) if m]
    end = TEMPLATES[name.split("+")[0]][2]
    assert tokenizer.decode(masked) == "".join(t["content"] + end for t in conversation if t["role"] == "assistant")


def test_plain_text_ends_with_exactly_one_eos():
    """An EOS was appended even to texts (or tokenizers) that already end with it."""
    from datasets import Dataset

    from longpeft.recipes.data import tokenize_dataset

    tokenizer = train_tokenizer(sample_text())
    eos = tokenizer.eos_token
    rows = tokenize_dataset(Dataset.from_dict({"text": ["the river city", f"the river city{eos}"]}), tokenizer, False)
    first, second = rows["input_ids"]
    assert first == second and first[-1] == tokenizer.eos_token_id and first[-2] != tokenizer.eos_token_id


def test_cached_tokenization_is_redone_when_longpeft_tokenizing_code_changes(tmp_path, monkeypatch):
    """datasets' cache key named longpeft's tokenizing functions without their code: after an upgrade that changed
    the masks, a data file tokenized before was read back from the old cache. Rerunning unchanged code still reuses
    the cache (a resumed run does not tokenize again)."""
    from datasets import load_dataset

    from longpeft.recipes import data

    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    tokenizer = marker_free_tokenizer("llama3")

    def cache_file() -> str:
        rows = load_dataset(
            "json", data_files=str(tmp_path / "chat.jsonl"), split="train", cache_dir=str(tmp_path / "c")
        )
        return data.tokenize_dataset(rows, tokenizer, True).cache_files[0]["filename"]

    first = cache_file()
    assert cache_file() == first
    changed = tmp_path / "data.py"
    changed.write_text(data.TOKENIZING_CODE.read_text() + "\n# a newer longpeft\n")
    monkeypatch.setattr(data, "TOKENIZING_CODE", changed)
    assert cache_file() != first


def test_a_template_whose_prefix_renders_differently_is_refused():
    tokenizer = marker_free_tokenizer("chatml")
    # Renders the last turn differently from earlier ones: prefixes are not prefixes of the whole.
    tokenizer.chat_template = (
        "{% for message in messages %}{% if loop.last %}[last]{% endif %}{{ message['content'] }}\n{% endfor %}"
    )
    with pytest.raises(ValueError, match="train.assistant_only_loss: false"):
        tokenize_conversation(tokenizer, CONVERSATION, assistant_only=True)


def test_training_runs_on_a_marker_free_chat_template(tmp_path, chat_jsonl):
    """The defect: TRL refused such templates ("not training-compatible"); longpeft builds the masks."""
    tokenizer = marker_free_tokenizer("chatml")
    base = tmp_path / "base"
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    recipe = load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={base}",
            f"data.source={chat_jsonl}",
            "data.max_length=256",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=1",
            "train.global_batch_size=1",
            "train.per_device_batch_size=1",
            "lora.r=2",
            "lora.embeddings=none",
        ],
    )
    result = run(recipe)
    assert result.metrics["steps"] == 1 and result.metrics["final_loss"] > 0


PLAIN_LOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
ids = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model(ids).logits, sys.argv[3])
print("TIED", model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr())
"""


def passkey_rows(tokenizer) -> list[int]:
    """Token ids of "The passkey is", which every assistant answer of ``chat_jsonl`` starts with."""
    return tokenizer("The passkey is", add_special_tokens=False)["input_ids"]


def embedding_overrides(embeddings: str, tokenizer) -> list[str]:
    """Recipe overrides training the whole embedding, or only the :func:`passkey_rows` rows."""
    if embeddings == "full":
        return ["lora.embeddings=full"]
    return ["lora.embeddings=token_indices", f"lora.trainable_token_indices={passkey_rows(tokenizer)}"]


@pytest.mark.parametrize(("tied", "embeddings"), [(True, "full"), (False, "full"), (True, "token_indices")])
def test_trained_embedding_on_tied_and_untied_bases(tmp_path, tokenizer, chat_jsonl, tied, embeddings):
    """A user expects the base's tying to survive: a tied base trains one matrix and merges tied."""
    base = tmp_path / "base"
    tiny_model("llama", vocab_size=len(tokenizer), tie_word_embeddings=tied).save_pretrained(base)
    tokenizer.save_pretrained(base)
    recipe = load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={base}",
            f"data.source={chat_jsonl}",
            "data.max_length=256",
            f"output_dir={tmp_path / 'run'}",
            "train.max_steps=2",
            "train.global_batch_size=1",
            "train.per_device_batch_size=1",
            "lora.r=2",
            "train.learning_rate=0.05",
            *embedding_overrides(embeddings, tokenizer),
        ],
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        result = run(recipe)
    assert not [w for w in record if "ensure_weight_tying" in str(w.message)]
    weights = load_file(result.adapter_dir / "adapter_model.safetensors")
    assert any("embed_tokens" in k for k in weights)

    loaded = longpeft.load(str(base), result.adapter_dir).eval()
    inner = loaded.get_base_model()
    trained_embedding = inner.get_input_embeddings().weight
    stock = AutoModelForCausalLM.from_pretrained(base)
    assert not torch.equal(trained_embedding, stock.get_input_embeddings().weight)  # the embedding trained
    head = inner.get_output_embeddings().weight
    assert torch.equal(head, trained_embedding) == tied  # tied: the head is the trained embedding

    ids = torch.randint(0, len(tokenizer), (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = loaded(ids).logits
    merged_dir = tmp_path / "merged"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        hub.merge(result.adapter_dir, merged_dir)
    assert not [w for w in record if "no longer tied" in str(w.message)]
    assert json.loads((merged_dir / "config.json").read_text()).get("tie_word_embeddings", False) == tied
    torch.save(ids, tmp_path / "ids.pt")
    out = subprocess.run(
        [sys.executable, "-c", PLAIN_LOAD, str(merged_dir), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"TIED {tied}" in out.stdout
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-4, rtol=1e-4)


def test_fused_loss_with_token_indices_on_a_tied_base_equals_the_plain_model_loss(tmp_path, tokenizer, chat_jsonl):
    """The defect: TRL's fused LM head read ``lm_head.bias`` from the head peft wraps for the trained rows
    (``TrainableTokensWrapper``, no ``bias``) and every step failed; its loss must score with the trained rows."""
    base = tmp_path / "base"
    tiny_model("llama", vocab_size=len(tokenizer), tie_word_embeddings=True).save_pretrained(base)
    tokenizer.save_pretrained(base)
    prepared = prepare(
        load_recipe(
            "tiny-cpu",
            [
                f"model.name_or_path={base}",
                f"data.source={chat_jsonl}",
                "data.max_length=256",
                f"output_dir={tmp_path / 'run'}",
                "train.per_device_batch_size=2",
                "train.global_batch_size=2",
                "lora.r=2",
                *embedding_overrides("token_indices", tokenizer),
            ],
        )
    )
    model = prepared.trainer.model.eval()
    rows = passkey_rows(tokenizer)
    trained = torch.randn(len(rows), model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # as if trained; LoRA's B is still zero, so LoRA changes nothing
        model.get_input_embeddings().token_adapter.trainable_tokens_delta["default"].copy_(trained)
    batch = next(iter(prepared.trainer.get_train_dataloader()))
    labels = batch["labels"][:, 1:]
    assert torch.isin(labels.cpu(), torch.tensor(rows)).any()  # trained rows are scored targets: the head's rows count
    with torch.no_grad():
        loss = prepared.trainer.compute_loss(model, dict(batch))

    # Independent reference: a plain transformers model (no peft, no TRL) whose one tied matrix has the trained rows.
    plain = AutoModelForCausalLM.from_pretrained(base, attn_implementation="sdpa").to(model.device).eval()
    apply_spec(plain, prepared.spec)
    with torch.no_grad():
        plain.get_input_embeddings().weight[rows] = trained.to(model.device)
        logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    reference = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)
    torch.testing.assert_close(loss, reference, atol=1e-5, rtol=1e-5)


def test_token_indices_on_a_tied_head_with_a_bias_is_refused(tokenizer):
    """peft's trainable tokens leave a tied head's bias out of its forward: the adapter would not be the model."""
    model = tiny_model("llama", vocab_size=len(tokenizer), tie_word_embeddings=True)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(len(tokenizer)))
    recipe = load_recipe("tiny-cpu", embedding_overrides("token_indices", tokenizer))
    with pytest.raises(ValueError, match="lora.embeddings: token_indices .* bias"):
        lora_config(recipe, model)
    assert lora_config(load_recipe("tiny-cpu"), model).ensure_weight_tying  # full: trained as one matrix


@pytest.mark.parametrize("embeddings", ["token_indices", "full"])
def test_a_trained_embedding_beside_activation_beacon_leaves_the_beacon_row_alone(
    tmp_path, tiny_base_dirs, tokenizer, chat_jsonl, embeddings
):
    """peft matches module names by suffix: ``embed_tokens`` also wrapped the beacon's one-row
    ``beacon_embed_tokens`` (token_indices: IndexError in prepare; full: a second trained copy of the beacon row)."""
    recipe = load_recipe(
        "tiny-beacon-cpu",
        [
            f"model.name_or_path={tiny_base_dirs('llama')}",
            f"data.source={chat_jsonl}",
            "data.max_length=256",
            f"output_dir={tmp_path / 'run'}",
            "beacon.window=16",
            "train.max_steps=1",
            "train.per_device_batch_size=1",
            "train.global_batch_size=1",
            "finetune=lora",
            "lora.r=2",
            *embedding_overrides(embeddings, tokenizer),
        ],
    )
    model = prepare(recipe).trainer.model
    wrapped = [
        name
        for name, module in model.named_modules()
        if "beacon_embed_tokens" in name
        and type(module).__name__ in ("TrainableTokensWrapper", "ModulesToSaveWrapper")
    ]
    assert wrapped == []
    assert type(model.get_input_embeddings()).__name__ in ("TrainableTokensWrapper", "ModulesToSaveWrapper")
