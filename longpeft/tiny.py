"""Tiny models and an in-memory tokenizer, no downloads (tests, `make demo`, benchmarks): a byte-level BPE with one
token per digit and a chat template whose ``{% generation %}`` marks assistant turns (TRL's assistant-only loss);
turns end with ``<|end|>``, the eos token, and ``</s>`` is a second eos id.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .errors import ConfigError

if TYPE_CHECKING:  # a tiny base's settings and vocabulary are read torch-free (recipe validation): see tiny_settings
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}\n"
    "{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Architectures the tests cover: name -> (model_type, overrides): grouped-query attention but "llama-mha"; "qwen2" has
# q/k/v biases, "qwen3" q/k norms; "llama-tied" ties its output head to the input embedding.
TINY_ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "llama-mha": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 4}),
    "llama-tied": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    "mistral": ("mistral", {"num_attention_heads": 4, "num_key_value_heads": 2, "sliding_window": None}),
    "qwen2": ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2}),
    "qwen3": ("qwen3", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}),
}

_WORDS = (
    "the a an of to in and is was for on with as by at from that this it be are were has had "
    "river city report year market north south east west council garden harbor station village "
    "engineer doctor teacher captain farmer writer merchant painter sailor pilot baker judge "
    "red blue green silver golden quiet bright ancient modern small large early late "
    "built opened moved found wrote sold visited repaired painted crossed planted measured "
    "key value passkey number secret code remember question answer what which who where when "
    "first second third last one two three four five six seven eight nine ten"
).split()


def sample_text(n_sentences: int = 400, seed: int = 0) -> list[str]:
    """Deterministic filler sentences (words, digits, punctuation) to train the tiny tokenizer on."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ":", ","]))
    return lines


def train_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer for transformers trained in memory on ``texts`` (default :func:`sample_text`), of
    ``vocab_size`` tokens including the special tokens and the 256 byte symbols."""
    from transformers import PreTrainedTokenizerFast

    tokens = dict(bos_token="<s>", eos_token="<|end|>", pad_token="<pad>", unk_token=None)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=_train_backend(texts, vocab_size), **tokens)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _train_backend(texts: Iterable[str] | None, vocab_size: int) -> Tokenizer:
    """The byte-level BPE of :func:`train_tokenizer`, trained by the tokenizers library alone."""
    texts = list(texts) if texts is not None else sample_text()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    backend.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet)
    trainer.show_progress = False
    backend.train_from_iterator(texts, trainer=trainer)
    return backend


def _demo_texts() -> list[str]:
    from .synth_data.corpus import corpus_texts

    return corpus_texts(n=40, seed=0) + sample_text()


def demo_tokenizer() -> PreTrainedTokenizerFast:
    """The tokenizer of ``tiny:`` models and the demo, trained on the procedural corpus and :func:`sample_text`."""
    return train_tokenizer(_demo_texts())


@lru_cache(maxsize=1)
def demo_vocab_size() -> int:
    """``len(demo_tokenizer())``, the vocabulary of ``tiny:`` models, computed without transformers."""
    return _train_backend(_demo_texts(), 512).get_vocab_size(with_added_tokens=True)


def tiny_settings(arch: str = "llama", vocab_size: int = 512, **overrides: Any) -> dict[str, Any]:
    """The ``config.json`` content of a tiny model of ``arch`` (:data:`TINY_ARCHITECTURES`) with ``overrides``, the
    attention kernel as ``attn_implementation`` (no torch). Hidden 64, 2 layers, RoPE base 10000, 256 positions."""
    if arch not in TINY_ARCHITECTURES:
        raise ConfigError(f"unknown tiny architecture {arch!r}; choose one of {sorted(TINY_ARCHITECTURES)}")
    model_type, arch_overrides = TINY_ARCHITECTURES[arch]
    settings: dict[str, Any] = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    settings |= dict(max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    settings |= dict(tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=[6, 2])
    return {"model_type": model_type, **settings, "attn_implementation": "eager", **arch_overrides, **overrides}


def tiny_config(arch: str = "llama", vocab_size: int = 512, **overrides: Any):
    """A transformers config for a tiny model of the given architecture (:func:`tiny_settings`)."""
    from transformers import AutoConfig

    settings = tiny_settings(arch, vocab_size, **overrides)
    attn_implementation = settings.pop("attn_implementation")
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    config._attn_implementation = attn_implementation
    return config


def tiny_model(arch: str = "llama", seed: int = 0, vocab_size: int = 512, **overrides: Any) -> PreTrainedModel:
    """A randomly initialised (seeded) tiny causal LM in fp32 eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, vocab_size=vocab_size, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation).eval()
