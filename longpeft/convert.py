"""Converters from other formats into longpeft adapters: Activation Beacon's released models. As merge does, a
conversion checks its sources and output folder before any download and writes atomically.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from huggingface_hub import hf_hub_download, snapshot_download
from safetensors.torch import save_file

from .adapters.beacon import WEIGHTS_FILENAME
from .adapters.beacon.authors_config import check_built_on, config_from_authors
from .adapters.beacon.weights import AUTHORS_TENSOR, authors_tensor_shape
from .errors import DataError, ModelSourceError
from .files import check_model_source, check_output_folder, written_atomically
from .reading import read_json_object, read_safetensors
from .spec import ContextSpec


def _checkpoint_files(source: str | Path) -> tuple[Path, dict[str, Any], list[Path]]:
    """(folder, config.json, the safetensors files that hold beacon tensors) of a local folder or Hub repo (whose
    config and index are downloaded, then the files the index names, or ``model.safetensors``)."""
    local = Path(source).is_dir()
    patterns = ["config.json", "*.safetensors.index.json"]
    folder = Path(source if local else snapshot_download(str(source), allow_patterns=patterns))
    index = next(iter(folder.glob("*.safetensors.index.json")), None)
    if index is not None:
        names = sorted({f for k, f in _weight_map(index).items() if AUTHORS_TENSOR.match(k)})
    else:
        names = [path.name for path in sorted(folder.glob("*.safetensors"))] if local else ["model.safetensors"]
    files = [folder / name if local else Path(hf_hub_download(str(source), name)) for name in names]
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelSourceError(f"{source}: no config.json; give the folder (or Hub id) of an Activation Beacon model")
    return folder, read_json_object(config_path, "the authors' config"), files


def _weight_map(index: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor -> file) of a ``*.safetensors.index.json``."""
    weight_map = read_json_object(index, "safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise DataError(f"{index}: no weight_map of tensor names to file names; download the model again")
    return weight_map


def check_beacon_tensors(tensors: dict[str, torch.Tensor], path: Path, base_config: Any, base: str | Path) -> None:
    """Raise a DataError naming ``path`` and the tensor for an authors' beacon tensor whose shape is not the one the
    base gives it (:func:`authors_tensor_shape`) or that holds NaN or infinity."""
    for name, tensor in tensors.items():
        expected = authors_tensor_shape(name, base_config)
        if tuple(tensor.shape) != expected:
            raise DataError(
                f"{path}: {name} has shape {tuple(tensor.shape)}, and on the base {base} it must be "
                f"{expected}; the checkpoint is damaged or built on another base (--base)"
            )
        if not torch.isfinite(tensor).all():
            bad = int((~torch.isfinite(tensor)).sum())
            raise DataError(
                f"{path}: {name} holds {bad} NaN or infinite values; the checkpoint is damaged: download it again"
            )


def convert_authors_beacon(source: str | Path, out_dir: str | Path, base: str | Path) -> dict[str, Any]:
    """Write into ``out_dir`` a longpeft beacon adapter (``longpeft.json``, ``beacon_adapter.safetensors``) for
    ``longpeft.load(base, out_dir)`` from an authors' released Activation Beacon model ``source`` (a folder or Hub
    id, e.g. ``namespace-Pt/beacon-qwen-2-7b-instruct``) built on ``base``, reading its ``beacon_*`` settings and
    beacon tensors only (no remote code runs). Returns ``{"out_dir", "tensors", "beacon"}``."""
    from transformers import AutoConfig

    out_dir = Path(out_dir)
    check_output_folder(out_dir, {"the authors' model": Path(source)})  # before any download
    check_model_source(source, "the authors' model")
    check_model_source(base, "--base")
    folder, checkpoint_config, files = _checkpoint_files(source)
    config_file = str(folder / "config.json")
    beacon = config_from_authors(checkpoint_config, config_file)
    base_config = AutoConfig.from_pretrained(str(base), trust_remote_code=False)
    check_built_on(checkpoint_config, base_config, beacon, str(source), str(base), config_file)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        read = {k: t.float().contiguous() for k, t in read_safetensors(path, AUTHORS_TENSOR.match).items()}
        check_beacon_tensors(read, path, base_config, base)
        tensors.update(read)
    expected = {
        f"model.layers.{i}.self_attn.beacon_{p}_proj.weight"
        for i in range(base_config.num_hidden_layers)
        for p in beacon.params
    } | {"model.beacon_embed_tokens.weight"}
    missing = sorted(expected - set(tensors))
    if missing:
        raise DataError(
            f"{source} lacks beacon tensors {missing[:4]} (beacon_param in {config_file} says {beacon.params})"
        )
    projections = {name.split(".")[-2][len("beacon_")] for name in tensors if name.endswith("_proj.weight")}
    unlisted = sorted(projections - set(beacon.params))  # the layer count is the base's (check_built_on)
    if unlisted:
        raise DataError(
            f"{config_file}: beacon_param is {beacon.params}, and {source} holds beacon weights of the "
            f"{'/'.join(unlisted)} projections too; edit beacon_param there to list every projection it has beacon "
            "weights for"
        )
    spec = ContextSpec.from_base(
        base_config, "beacon", base_model=str(base), methods={"beacon": beacon.model_dump()}, weights="method"
    )
    needed = sum(t.numel() * t.element_size() for t in tensors.values())
    with written_atomically(out_dir.resolve(), needed) as partial:  # a failure leaves no adapter that looks complete
        save_file(tensors, str(partial / WEIGHTS_FILENAME), metadata={"format": "pt", "source": str(source)})
        spec.save(partial)
    return {"out_dir": str(out_dir), "tensors": len(tensors), "beacon": beacon.model_dump()}
