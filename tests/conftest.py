"""Shared fixtures: tiny models saved to disk, the in-memory tokenizer, small chat datasets."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

if "PYTEST_XDIST_WORKER" in os.environ:  # `make test` runs one worker per core: one torch thread each (read at import)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
from hypothesis import HealthCheck, settings

from longpeft.tiny import sample_text, tiny_model, train_tokenizer

# Property tests (Hypothesis): `make test` runs the "ci" profile (few examples, no deadline: a loaded 2-core machine
# is slow), `make test-slow` the "slow" one (HYPOTHESIS_PROFILE=slow). Examples are drawn afresh on every run
# (derandomize off) and a failure prints the example that reproduces it.
settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile(
    "slow", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tokenizer():
    return train_tokenizer(sample_text())


@pytest.fixture(scope="session")
def tiny_base_dirs(tmp_path_factory, tokenizer):
    """Factory: arch -> folder with a saved tiny base model and tokenizer (built once per arch)."""
    cache: dict[str, Path] = {}

    def make(arch: str = "llama") -> Path:
        if arch not in cache:
            folder = tmp_path_factory.mktemp(f"base-{arch}")
            model = tiny_model(arch, seed=0, vocab_size=len(tokenizer))
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            cache[arch] = folder
        return cache[arch]

    return make


def write_chat_jsonl(path: Path, n: int = 8, filler_words: int = 40, seed: int = 0) -> Path:
    """Passkey-style conversations (context in the user turn, answer in the assistant turn)."""
    rng = random.Random(seed)
    words = "the river city report market north south garden harbor station".split()
    with path.open("w") as f:
        for _ in range(n):
            key = rng.randint(10000, 99999)
            filler = " ".join(rng.choice(words) for _ in range(filler_words))
            messages = [
                {"role": "user", "content": f"{filler} The passkey is {key}. {filler} What is the passkey?"},
                {"role": "assistant", "content": f"The passkey is {key}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


@pytest.fixture
def chat_jsonl(tmp_path):
    return write_chat_jsonl(tmp_path / "train.jsonl")


@pytest.fixture
def single_thread():
    """Run a test on one torch thread: tiny models on a shared machine are much faster without thread contention."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
