"""What train, merge, export and push write names no path of the machine that wrote it: every text file of the run's
adapter/ (and a full fine-tune's model/), a merged and an exported folder and a staged push holds no absolute local
path. Cards name their folder by a marked placeholder (or the Hub repo), the base by its Hub id when known;
longpeft.json names a local base relative to its own folder (so ``longpeft.load(None, adapter)`` still finds it, and
the two can move together), and a push without ``--base-id`` names none. ``export`` warns about a local base as push
does."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import longpeft
from longpeft import hub
from longpeft.recipes.runner import run
from longpeft.recipes.schema import load_recipe

pytestmark = pytest.mark.usefixtures("single_thread")


def text_files(folder: Path) -> dict[Path, str]:
    """Every file under ``folder`` that is UTF-8 text (weights are not)."""
    texts = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            try:
                texts[path] = path.read_text()
            except UnicodeDecodeError:
                continue
    return texts


def assert_no_local_path(folder: Path, *paths: Path) -> None:
    """No text file of ``folder`` holds any of ``paths`` (nor the working directory) as written or resolved."""
    needles = {str(p) for path in (*paths, Path.cwd()) for p in (path, path.resolve())}
    texts = text_files(folder)
    assert {"README.md", "longpeft.json"} & {path.name for path in texts}
    found = {
        f"{path.relative_to(folder)}: {needle}" for path, text in texts.items() for needle in needles if needle in text
    }
    assert not found


def run_on(base: Path, out: Path, *extra: str):
    return run(
        load_recipe(
            "tiny-cpu",
            [
                f"model.name_or_path={base}",
                f"data.source={out.parent / 'chat.jsonl'}",
                "data.max_length=256",
                f"output_dir={out}",
                "train.max_steps=1",
                "train.global_batch_size=1",
                "train.per_device_batch_size=1",
                "lora.r=2",
                *extra,
            ],
        )
    )


def test_train_merge_export_and_push_write_no_local_path(tiny_base_dirs, chat_jsonl, tmp_path):
    base = tmp_path / "bases" / "my-base"  # a local base outside the run folder
    shutil.copytree(tiny_base_dirs("llama"), base)
    shutil.copy(chat_jsonl, tmp_path / "chat.jsonl")
    result = run_on(base, tmp_path / "run", "lora.embeddings=full")
    adapter = result.adapter_dir
    spec = json.loads((adapter / "longpeft.json").read_text())
    assert spec["base_model"] == "../../bases/my-base"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == spec["base_model"]
    card = (adapter / "README.md").read_text()
    assert 'longpeft.load(None, "path/to/adapter")  # None: the base longpeft.json names (../../bases/my-base' in card

    hub.merge(adapter, tmp_path / "merged", verify=False)
    assert json.loads((tmp_path / "merged" / "longpeft.json").read_text())["base_model"] == "../bases/my-base"
    with pytest.warns(UserWarning, match=r"names its base model by a local path .*the exported card leaves it out"):
        hub.export(adapter, tmp_path / "exported", verify=False)
    assert (
        'from_pretrained("path/to/exported")  # path/to/exported: where this folder is'
        in (tmp_path / "exported" / "README.md").read_text()
    )
    hub.export(adapter, tmp_path / "exported-id", verify=False, base_id="owner/my-base")
    with pytest.warns(UserWarning, match=r"names its base model by a local path .*leave it out"):
        hub.push(result.output_dir, "someone/long", dry_run=tmp_path / "pushed")
        hub.push(result.output_dir, "someone/long", merged=True, dry_run=tmp_path / "pushed-merged")
    hub.push(adapter, "someone/long", base_id="owner/my-base", dry_run=tmp_path / "pushed-id")
    assert 'longpeft.load("owner/my-base", "someone/long")' in (tmp_path / "pushed-id" / "README.md").read_text()
    for name in ("pushed", "pushed-merged"):
        assert json.loads((tmp_path / name / "longpeft.json").read_text())["base_model"] is None
    assert json.loads((tmp_path / "pushed" / "adapter_config.json").read_text())["base_model_name_or_path"] is None

    full = run_on(base, tmp_path / "full", "finetune=full", "train.learning_rate=1e-5")
    for folder in (
        adapter,
        full.adapter_dir,
        *(tmp_path / n for n in ("merged", "exported", "exported-id", "pushed", "pushed-merged", "pushed-id")),
    ):
        assert_no_local_path(folder, tmp_path, base, Path(os.path.expanduser("~")))

    moved = tmp_path / "elsewhere"  # the base's folder and the run's, moved together
    (moved / "bases").mkdir(parents=True)
    shutil.move(base, moved / "bases" / "my-base")
    shutil.move(result.output_dir, moved / "run")
    assert longpeft.load(None, moved / "run" / "adapter").config.rope_parameters["rope_theta"] == 1e6
