"""A trained embedding tied to the output head (``tie_word_embeddings``, ``lora.embeddings: full``): the run's
adapter is in peft's own format (plain ``PeftModel.from_pretrained`` loads it), each checkpoint keeps the matrix once,
and every reader gives the model that trained: plain peft, ``longpeft.load`` (eval, export) and its ``tie_weights()``
(which lm-eval's ``HFLM`` calls: tests/test_eval_harness.py), merge, a resume from a checkpoint, ``model.init_from``,
and a push of an adapter written in the compact form."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, TrainerCallback

import longpeft
from longpeft import hub
from longpeft.adapter_weights import TIED_METADATA, load_adapter
from longpeft.reading import DTYPE_BYTES, safetensors_header
from longpeft.recipes.runner import prepare, run
from longpeft.recipes.schema import load_recipe

from run_helpers import assert_same_weights, undo_after_checkpoint

# compat: also run by `make test-compat` (transformers 5.17, trl 1.15, datasets 4)
pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.compat]

EMBEDDING = "base_model.model.model.embed_tokens.weight"
HEAD = "base_model.model.lm_head.weight"
IDS = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(0))


class TrainedLogits(TrainerCallback):
    """The logits of :data:`IDS` through the model in memory when training ends (the reference every reader must
    give back)."""

    logits: torch.Tensor | None = None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        model.eval()
        with torch.no_grad():
            self.logits = model(IDS.to(model.device)).logits.cpu()  # the Trainer may hold it on the GPU
        model.train()


def tied_recipe(base, data, out, *extra):
    return load_recipe(
        "tiny-cpu",
        [
            f"model.name_or_path={base}",
            f"data.source={data}",
            "data.max_length=256",
            f"output_dir={out}",
            "train.max_steps=2",
            "train.save_steps=1",
            "train.global_batch_size=1",
            "train.per_device_batch_size=1",
            "lora.r=2",
            "train.learning_rate=0.05",
            "lora.embeddings=full",
            *extra,
        ],
    )


def embedding_bytes(model_dir) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    return config["vocab_size"] * config["hidden_size"] * 4


def assert_in_peft_format(folder, base) -> None:
    """The adapter file of ``folder`` is as peft writes it: the trained embedding under both its names (equal), no
    record of left-out copies, and its tensors take the embedding's bytes twice."""
    path = folder / "adapter_model.safetensors"
    header = safetensors_header(path)
    assert sorted(k for k in header if "embed_tokens" in k or "lm_head" in k) == sorted([EMBEDDING, HEAD])
    with safe_open(str(path), framework="pt") as handle:
        assert TIED_METADATA not in (handle.metadata() or {})
        assert torch.equal(handle.get_tensor(HEAD), handle.get_tensor(EMBEDDING))
    tensor_bytes = sum(entry["data_offsets"][1] - entry["data_offsets"][0] for entry in header.values())
    lora_bytes = sum(
        DTYPE_BYTES[e["dtype"]] * e["shape"][0] * e["shape"][1] for name, e in header.items() if "lora_" in name
    )
    assert tensor_bytes == 2 * embedding_bytes(base) + lora_bytes


def assert_holds_the_embedding_once(folder, base) -> None:
    """The adapter file of ``folder`` holds the trained embedding under one name (the head's is recorded as tied to
    it), and its tensors take the embedding's bytes once."""
    path = folder / "adapter_model.safetensors"
    header = safetensors_header(path)
    assert [k for k in header if "embed_tokens" in k or "lm_head" in k] == [EMBEDDING]
    with safe_open(str(path), framework="pt") as handle:
        assert json.loads(handle.metadata()[TIED_METADATA]) == {HEAD: EMBEDDING}
    tensor_bytes = sum(entry["data_offsets"][1] - entry["data_offsets"][0] for entry in header.values())
    lora_bytes = sum(
        DTYPE_BYTES[e["dtype"]] * e["shape"][0] * e["shape"][1] for name, e in header.items() if "lora_" in name
    )
    assert tensor_bytes == embedding_bytes(base) + lora_bytes
    assert path.stat().st_size < 1.2 * tensor_bytes  # the header adds little; before, twice the embedding


def test_a_tied_embedding_is_saved_in_peft_format_and_read_back_tied(tiny_base_dirs, chat_jsonl, tmp_path):
    from peft import PeftModel

    from longpeft.adapters import apply_spec
    from longpeft.spec import ContextSpec

    base = tiny_base_dirs("llama-tied")
    trained = TrainedLogits()
    with pytest.warns(UserWarning, match=r"plain PeftModel.from_pretrained .* leaves out .*rope_theta 10000.0 -> "):
        result = run(tied_recipe(base, chat_jsonl, tmp_path / "run"), callbacks=[trained])
    assert_in_peft_format(result.adapter_dir, base)
    for step in (1, 2):
        assert_holds_the_embedding_once(result.output_dir / "checkpoints" / f"checkpoint-{step}", base)

    # plain peft, on the base given longpeft.json's RoPE change (which it cannot know: the card and warning say so)
    stock = AutoModelForCausalLM.from_pretrained(base)
    apply_spec(stock, ContextSpec.load(result.adapter_dir))
    plain = PeftModel.from_pretrained(stock, str(result.adapter_dir)).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS).logits, trained.logits, atol=1e-5, rtol=0)

    loaded = longpeft.load(str(base), result.adapter_dir)  # eval --adapter and export load through it
    inner = loaded.get_base_model()
    assert inner.get_output_embeddings().weight is inner.get_input_embeddings().weight  # tied again, one parameter
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training
    stock = AutoModelForCausalLM.from_pretrained(base)
    assert not torch.equal(inner.get_input_embeddings().weight, stock.get_input_embeddings().weight)  # it trained
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, trained.logits, atol=1e-5, rtol=0)
    loaded.tie_weights()  # as lm-eval's HFLM does with the model it is given (tests/test_eval_harness.py runs it)
    assert inner.get_output_embeddings().weight is inner.get_input_embeddings().weight
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, trained.logits, atol=1e-5, rtol=0)

    merged = tmp_path / "merged"
    hub.merge(result.adapter_dir, merged)
    assert json.loads((merged / "config.json").read_text())["tie_word_embeddings"] is True
    assert [k for k in safetensors_header(merged / "model.safetensors") if "embed_tokens" in k or "lm_head" in k] == [
        "model.embed_tokens.weight"
    ]
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()  # plain transformers: no longpeft, no peft
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS).logits, trained.logits, atol=1e-5, rtol=0)

    killed = tmp_path / "killed"  # a kill after checkpoint 1: the resume reads its once-written embedding
    undo_after_checkpoint(result.output_dir, killed, 1, 2)
    resumed = run(tied_recipe(base, chat_jsonl, killed), resume=True)
    assert_same_weights(
        result.adapter_dir / "adapter_model.safetensors",
        resumed.adapter_dir / "adapter_model.safetensors",
        atol=1e-6,
        rtol=0,
    )

    started = prepare(tied_recipe(base, chat_jsonl, tmp_path / "stage2", f"model.init_from={result.adapter_dir}"))
    model = started.trainer.model
    head = model.get_base_model().get_output_embeddings().weight
    assert head is model.get_base_model().get_input_embeddings().weight
    torch.testing.assert_close(head.cpu(), inner.get_input_embeddings().weight.cpu(), atol=0, rtol=0)


def test_an_adapter_of_both_names_as_peft_writes_it_still_loads(tiny_base_dirs, tmp_path):
    """Adapters written before (and by peft itself) hold the tied embedding under both names: loaded as they are."""
    from peft import LoraConfig, get_peft_model

    from longpeft.adapter_weights import tied_copies
    from longpeft.tiny import tiny_model

    model = get_peft_model(
        tiny_model("llama-tied", vocab_size=400),
        LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["model.embed_tokens"], ensure_weight_tying=True),
    )
    assert tied_copies(model) == {HEAD: EMBEDDING}
    with torch.no_grad():
        model.get_base_model().get_input_embeddings().weight.add_(1.0)
        expected = model(IDS).logits
    model.save_pretrained(tmp_path)
    assert {HEAD, EMBEDDING} <= set(safetensors_header(tmp_path / "adapter_model.safetensors"))
    loaded = load_adapter(tiny_model("llama-tied", vocab_size=400), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(loaded(IDS).logits, expected, atol=1e-6, rtol=0)


def test_an_adapter_written_compact_is_pushed_in_peft_format(tiny_base_dirs, tmp_path):
    """An adapter folder that keeps the tied embedding once (as checkpoints do) is uploaded in peft's own format,
    which plain peft loads to the same model."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from longpeft.adapter_weights import leave_out_tied_copies
    from longpeft.spec import ContextSpec

    base = tiny_base_dirs("llama-tied")
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base),
        LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["model.embed_tokens"], ensure_weight_tying=True),
    )
    with torch.no_grad():
        model.get_base_model().get_input_embeddings().weight.add_(1.0)
        expected = model(IDS).logits
    model.save_pretrained(tmp_path / "adapter")
    assert leave_out_tied_copies(model, tmp_path / "adapter") == {HEAD: EMBEDDING}
    ContextSpec.from_base(model.config, "rope", base_model="owner/base").save(tmp_path / "adapter")
    hub.push(tmp_path / "adapter", "someone/tied", dry_run=tmp_path / "upload")
    assert_in_peft_format(tmp_path / "upload", base)
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(tmp_path / "upload")).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(IDS).logits, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("record", ["{not json", '["a list"]', json.dumps({HEAD: "missing.weight"})])
def test_a_damaged_record_of_tied_names_is_named(tmp_path, record):
    from safetensors.torch import save_file

    from longpeft.adapter_weights import adapter_weights
    from longpeft.errors import DataError

    save_file(
        {EMBEDDING: torch.zeros(4, 2)},
        str(tmp_path / "adapter_model.safetensors"),
        metadata={"format": "pt", TIED_METADATA: record},
    )
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    with pytest.raises(DataError, match=r"adapter_model.safetensors: .*re-create it"):
        adapter_weights(tmp_path)
