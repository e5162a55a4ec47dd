"""A LoRA adapter's weights file on a base whose output head shares the input embedding's weight: peft's own format
for every folder users get, a compact one inside checkpoints.

On such a base (``tie_word_embeddings``), ``lora.embeddings: full`` trains one matrix: peft (``ensure_weight_tying``)
wraps the embedding and the head in ``modules_to_save`` and gives the head's trained copy the embedding's parameter.
peft's ``save_pretrained`` writes that matrix under both names (``...lm_head.weight`` and ``...embed_tokens.weight``,
identical), and peft's loaders (``PeftModel.from_pretrained``, ``set_peft_model_state_dict``) need both. That is the
format of the run's ``adapter/`` and of everything ``push`` uploads (:func:`write_tied_copies` restores the copies of
a compact file), so plain peft loads them.

Checkpoints keep the matrix once (they are written every ``save_steps`` and read back only by longpeft):
:func:`leave_out_tied_copies` rewrites the file peft wrote without the copies and records in its metadata
(``longpeft.tied``: ``{copy: the name it is tied to}``) what each left-out name holds. :func:`adapter_weights` reads
either format back with every copy in place, for ``set_peft_model_state_dict`` (where peft ties the two again, as it
did when it built the model: the copy and its matrix are one parameter); :func:`load_adapter` is
``PeftModel.from_pretrained`` that also reads a compact file. Every longpeft reader (load, merge, export, eval,
``model.init_from``, resume from a checkpoint) goes through them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from peft import PeftConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from peft.utils import load_peft_weights
from peft.utils.other import ModulesToSaveWrapper
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .errors import ConfigError, DataError
from .files import writing_to
from .peft_ties import tie_through_peft_wrappers

WEIGHTS_NAME = "adapter_model.safetensors"
TIED_METADATA = "longpeft.tied"


def tied_copies(model: Any) -> dict[str, str]:
    """``{name of a copy: name of the matrix it is tied to}`` among the weights peft saves for ``model`` (a
    PeftModel): each ``modules_to_save`` weight of its active adapter that is the parameter of an earlier one (on a
    tied base: the head's copy of the trained input embedding). Empty when nothing is tied (or no peft)."""
    return {copy: source for copy, source, _ in _tied_parameters(model)}


def tied_copies_bytes(model: Any) -> int:
    """Bytes the copies of :func:`tied_copies` add to peft's own format of ``model``'s adapter file."""
    return sum(parameter.numel() * parameter.element_size() for _, _, parameter in _tied_parameters(model))


def _tied_parameters(model: Any) -> list[tuple[str, str, Any]]:
    """``(copy, the name it is tied to, the parameter)`` of each copy of :func:`tied_copies`."""
    adapter = getattr(model, "active_adapter", "default")
    first: dict[int, str] = {}  # id(parameter) -> its first name
    copies = []
    for name, module in model.named_modules():
        if not isinstance(module, ModulesToSaveWrapper) or adapter not in module.modules_to_save:
            continue
        for key, parameter in module.modules_to_save[adapter].named_parameters():
            saved_name = f"{name}.{key}"  # as peft names it in the file (the adapter name left out)
            if id(parameter) in first:
                copies.append((saved_name, first[id(parameter)], parameter))
            else:
                first[id(parameter)] = saved_name
    return copies


def leave_out_tied_copies(model: Any, folder: str | Path) -> dict[str, str]:
    """Rewrite ``folder/adapter_model.safetensors``, as peft wrote it for ``model``, without the copies of
    :func:`tied_copies`, recording in its metadata what each one is tied to; returns what was left out (nothing when
    no copy is tied, or the folder holds no such file: a sharded checkpoint). The new file replaces the old one
    once complete."""
    path = Path(folder) / WEIGHTS_NAME
    copies = tied_copies(model)
    if not copies or not path.is_file():
        return {}

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        names = set(handle.keys())
        left_out = {copy: source for copy, source in copies.items() if copy in names and source in names}
        if not left_out:
            return {}
        kept = {name: handle.get_tensor(name) for name in names - set(left_out)}
    replace_weights_file(path, kept, {**metadata, TIED_METADATA: json.dumps(left_out, sort_keys=True)})
    return left_out


def write_tied_copies(folder: str | Path, copies: dict[str, str]) -> dict[str, str]:
    """Rewrite ``folder/adapter_model.safetensors`` in peft's own format: every name of ``copies`` (``{copy: the name
    it is tied to}``, e.g. :func:`tied_copies` of the model that wrote it, or :func:`tied_names` of a compact file)
    that the file lacks is written as the tensor it is tied to, and the compact form's record is dropped. Returns the
    copies written (nothing when the file already holds them all, or the folder holds no such file). The new file
    replaces the old one once complete.

    Raises:
        DataError: a name a copy is tied to is not in the file.
    """
    path = Path(folder) / WEIGHTS_NAME
    if not copies or not path.is_file():
        return {}

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
        names = set(handle.keys())
        added = {copy: source for copy, source in copies.items() if copy not in names}
        if not added and TIED_METADATA not in metadata:
            return {}
        lost = sorted(source for source in added.values() if source not in names)
        if lost:
            raise DataError(
                f"{path}: a tied copy's matrix {lost[0]} is not in the file (a damaged file); re-create it "
                "(or copy / download the folder again)"
            )
        tensors = {name: handle.get_tensor(name) for name in names}
    tensors.update({copy: tensors[source].clone() for copy, source in added.items()})  # safetensors refuses shared
    replace_weights_file(path, tensors, {k: v for k, v in metadata.items() if k != TIED_METADATA})
    return added


def replace_weights_file(path: Path, tensors: dict[str, Any], metadata: dict[str, str]) -> None:
    """Write ``tensors`` with ``metadata`` to ``path`` through a temporary name beside it, renamed into place once
    complete: a failure keeps the old file; a full disk or a refused write is an OutputWriteError naming its folder."""
    partial = path.with_name(f".{path.name}.partial")
    with writing_to(path.parent):
        try:
            save_file(tensors, str(partial), metadata=metadata)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)


def tied_names(folder: str | Path) -> dict[str, str]:
    """``{copy: the name it is tied to}`` that ``folder``'s adapter file left out (empty for a file holding every
    weight, as peft writes them, or a folder without ``adapter_model.safetensors``).

    Raises:
        DataError: the file's record of them is not a JSON object of names.
    """
    path = Path(folder) / WEIGHTS_NAME
    if not path.is_file():
        return {}

    try:
        with safe_open(str(path), framework="pt") as handle:
            raw = (handle.metadata() or {}).get(TIED_METADATA)
    except SafetensorError as error:
        raise DataError(
            f"{path}: could not be read ({str(error).splitlines()[0]}); re-create it (or copy / "
            "download the folder again)"
        ) from None
    if raw is None:
        return {}
    try:
        names = json.loads(raw)
    except ValueError:
        names = None
    if not isinstance(names, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        raise DataError(
            f"{path}: its {TIED_METADATA} metadata is not a JSON object of tensor names; re-create it "
            "(or copy / download the folder again)"
        )
    return names


def adapter_weights(folder: str | Path) -> dict[str, Any]:
    """The adapter weights of ``folder`` as peft reads them (``load_peft_weights``, on the CPU), every tied copy the
    file left out restored as the tensor it is tied to.

    Raises:
        DataError: a name the file ties a copy to is not in the file.
    """
    weights = load_peft_weights(str(folder), device="cpu")
    for copy, source in tied_names(folder).items():
        if source not in weights:
            raise DataError(
                f"{Path(folder) / WEIGHTS_NAME}: {copy} is tied to {source}, which the file does not "
                "hold (a damaged file); re-create it (or copy / download the folder again)"
            )
        weights[copy] = weights[source]
    return weights


def load_weights_into(model: Any, folder: str | Path) -> Any:
    """Load ``folder``'s adapter weights (:func:`adapter_weights`) into ``model``, a PeftModel built with the
    adapter's config; returns peft's load result (``missing_keys``: every weight of the model the file lacked, the
    base's included; ``unexpected_keys``)."""
    return set_peft_model_state_dict(model, adapter_weights(folder))


def missing_adapter_weights(model: Any, result: Any) -> list[str]:
    """The weights of ``model``'s active adapter (LoRA, ``modules_to_save``) that a load (``result``) left unset."""
    marker = f".{getattr(model, 'active_adapter', 'default')}."
    return [name for name in result.missing_keys if marker in name]


def load_adapter(model: Any, folder: str | Path, is_trainable: bool = False) -> Any:
    """``PeftModel.from_pretrained(model, folder, is_trainable=is_trainable)``, which also reads an adapter file
    that left tied copies out (peft's own loader needs every name): the PeftModel is built from the folder's
    ``adapter_config.json`` (peft ties the copies again) and the weights are loaded into it. The model's
    ``tie_weights`` then ties what peft wrapped version by version
    (:func:`~longpeft.peft_ties.tie_through_peft_wrappers`: lm-eval's ``HFLM`` calls it).

    Raises:
        ConfigError: such an adapter on a base that ``device_map`` offloaded to CPU or disk in part.
        DataError: the file lacks weights of the adapter its config describes.
    """
    if not tied_names(folder):
        return tie_through_peft_wrappers(PeftModel.from_pretrained(model, str(folder), is_trainable=is_trainable))
    if any(parameter.device.type == "meta" for parameter in model.parameters()):
        raise ConfigError(
            f"{folder}: this adapter keeps its tied embedding once, which longpeft loads onto a base "
            "held in memory whole; load the base without offloading part of it to CPU or disk "
            "(device_map)"
        )
    config = PeftConfig.from_pretrained(str(folder))
    config.inference_mode = not is_trainable
    peft_model = get_peft_model(model, config)
    missing = missing_adapter_weights(peft_model, load_weights_into(peft_model, folder))
    if missing:
        raise DataError(
            f"{Path(folder) / WEIGHTS_NAME}: lacks {len(missing)} weights of the adapter its "
            f"adapter_config.json describes (e.g. {missing[0]}); re-create the folder (or copy / download "
            "it again)"
        )
    if not is_trainable:
        peft_model.eval()
    return tie_through_peft_wrappers(peft_model)
