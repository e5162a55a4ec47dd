"""One way to read the files longpeft takes in (weights, checkpoints, JSON): each failure is a DataError (unusable
content) or a ModelSourceError (a missing file) naming the file and what to do. Safetensors headers are checked
before any tensor is read; torch files load weights-only. torch and safetensors are imported only when needed.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import DataError, ModelSourceError
from .files import require_file

# bytes per element of each safetensors dtype (the format's own names)
DTYPE_BYTES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0"), 1),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 2),
    **dict.fromkeys(("I32", "U32", "F32"), 4),
    **dict.fromkeys(("I64", "U64", "F64", "C64"), 8),
}
MAX_HEADER_BYTES = 100_000_000  # as safetensors itself: a larger header is a foreign or broken file
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
REFUSED_FOR_SAFETY = "not a plain tensor file: refused for safety"


def _fix(path: Path) -> str:
    return f"re-create {path.name} (or copy / download the folder again)"


def read_json(path: str | Path, what: str = "") -> Any:
    """The JSON content of ``path`` (``what`` names it in messages, e.g. ``adapter config``): a ModelSourceError
    when missing, a DataError when not UTF-8 or not JSON (naming ``file:line:column``)."""
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelSourceError(f"{label}: no such file") from None
    except UnicodeDecodeError as error:
        raise DataError(f"{label}: not UTF-8 text (byte {error.start}); {_fix(path)}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise DataError(f"{path}:{error.lineno}:{error.colno}: not valid JSON ({error.msg}); {_fix(path)}") from None


def read_json_object(path: str | Path, what: str = "") -> dict[str, Any]:
    """:func:`read_json` of a file that must hold one JSON object (``{...}``)."""
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise DataError(
            f"{what + ' ' if what else ''}{path}: holds a JSON {type(data).__name__}, not an object "
            f"({{...}}); {_fix(Path(path))}"
        )
    return data


def safetensors_header(path: str | Path) -> dict[str, dict[str, Any]]:
    """``{tensor name: {"dtype", "shape", "data_offsets"}}`` of a safetensors file, checked without torch: a known
    dtype per tensor, and its bytes inside the file and matching its shape. A ModelSourceError when missing, else a
    DataError for anything wrong."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None
            if length is None or length > min(MAX_HEADER_BYTES, size - 8):
                state = "missing" if length is None else "too large or cut off"
                raise DataError(
                    f"{path}: not a safetensors file (the header is {state}: a truncated, damaged or "
                    f"foreign file); {_fix(path)}"
                )
            raw = handle.read(length)
    except FileNotFoundError:
        raise ModelSourceError(f"{path}: no such file") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DataError(f"{path}: not a safetensors file (its header is not JSON); {_fix(path)}") from None
    if not isinstance(header, dict):
        raise DataError(f"{path}: not a safetensors file (its header is not a JSON object); {_fix(path)}")
    data_bytes = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if problem := _entry_problem(entry, data_bytes):
            raise DataError(f"{path}: tensor {name!r} {problem} (a truncated or damaged file); {_fix(path)}")
        tensors[name] = entry
    return tensors


def _entry_problem(entry: Any, data_bytes: int) -> str | None:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        return "has no dtype, shape and data_offsets"
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_BYTES:
        return f"has an unknown dtype {dtype!r}"
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        return f"has a bad shape {shape!r}"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
        return f"has bad data_offsets {offsets!r}"
    start, end = offsets
    count = math.prod(shape)
    if not 0 <= start <= end <= data_bytes:
        return f"lies past the end of the file (bytes {start}-{end} of {data_bytes})"
    if end - start != count * DTYPE_BYTES[dtype]:
        return f"holds {end - start} bytes where {dtype} {shape} needs {count * DTYPE_BYTES[dtype]}"
    return None


def check_shapes(
    path: str | Path, header: dict[str, dict[str, Any]], expected: dict[str, tuple[int, ...]], source: str
) -> None:
    """A DataError for the first tensor of ``header`` whose shape is not ``expected``'s (from ``source``)."""
    for name, shape in expected.items():
        if name in header and tuple(header[name]["shape"]) != tuple(shape):
            raise DataError(
                f"{path}: tensor {name} has shape {list(header[name]['shape'])} where {source} gives "
                f"{list(shape)}; the weights and their config do not belong together: re-create or "
                "re-download the folder"
            )


def read_safetensors(
    path: str | Path,
    keep: Callable[[str], bool] = lambda name: True,
    expected: dict[str, tuple[int, ...]] | None = None,
    source: str = "",
) -> dict[str, Any]:
    """Tensors named as ``keep`` accepts, after :func:`safetensors_header` and :func:`check_shapes` (``expected``)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    header = safetensors_header(path)
    if expected:
        check_shapes(path, header, expected, source)
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys() if keep(name)}
    except SafetensorError as error:
        raise DataError(f"{path}: could not be read ({str(error).splitlines()[0]}); {_fix(path)}") from None


def read_torch_file(path: str | Path, map_location: Any = "cpu") -> Any:
    """A torch file (``.bin``, ``.pt``) loaded with ``weights_only=True``: a ModelSourceError when missing, a
    DataError for a refused pickle payload (:data:`REFUSED_FOR_SAFETY`) or a file that is not torch's."""
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise ModelSourceError(f"{path}: no such file")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:
        raise DataError(
            f"{path}: {REFUSED_FOR_SAFETY} (it holds Python objects that weights-only loading does not "
            "run); use a file longpeft or peft wrote, or a .safetensors file"
        ) from None
    except (RuntimeError, EOFError, ValueError) as error:
        raise DataError(
            f"{path}: not a torch tensor file ({str(error).splitlines()[0][:200]}); {_fix(path)}"
        ) from None


def lora_rank_shapes(header: dict[str, dict[str, Any]], config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape each LoRA tensor of ``header`` must have for the ranks of ``config`` (adapter_config.json):
    ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``, the other side as in the file; a module's rank is its
    ``rank_pattern``'s, else ``r``."""
    expected = {}
    for name, entry in header.items():
        shape, rank = entry["shape"], config.get("r")
        for pattern, value in (config.get("rank_pattern") or {}).items():
            if re.search(rf"(^|\.){pattern}\.lora_[AB]", name) or re.fullmatch(rf".*{pattern}\.lora_[AB]\..*", name):
                rank = value
        if not isinstance(rank, int) or len(shape) != 2:
            continue
        if ".lora_A." in name:
            expected[name] = (rank, shape[1])
        elif ".lora_B." in name:
            expected[name] = (shape[0], rank)
    return expected


def check_lora_adapter(folder: str | Path, what: str = "adapter") -> Path:
    """Check an adapter folder before peft reads it and return its weights file: ``adapter_config.json`` is a JSON
    object, the weights are there, a safetensors header and its LoRA ranks agree with the config (a ``.bin`` loads
    weights-only). A ModelSourceError for a missing file, a DataError for an unusable one."""
    folder = Path(folder)
    config = read_json_object(require_file(folder, "adapter_config.json", what), "adapter config")
    weights = next((folder / name for name in ADAPTER_WEIGHTS if (folder / name).is_file()), None)
    if weights is None:
        hint = "; the adapter's weights were not saved or were deleted: copy the whole folder again, or train again"
        require_file(folder, ADAPTER_WEIGHTS[0], what, hint)
    if weights.suffix == ".bin":
        read_torch_file(weights)
        return weights
    header = safetensors_header(weights)
    check_shapes(weights, header, lora_rank_shapes(header, config), f"adapter_config.json (r={config.get('r')})")
    return weights
