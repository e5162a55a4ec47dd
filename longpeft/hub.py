"""Merge an adapter into one model folder for ``AutoModelForCausalLM.from_pretrained`` (``export``: with its model
card), push an adapter or a whole model to the Hub, and convert Activation Beacon's released models into adapters.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import yaml
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, GenerationConfig

from .adapter_weights import tied_names, write_tied_copies
from .adapters import METHODS, export_methods, spec_methods
from .adapters.beacon import WEIGHTS_FILENAME
from .adapters.beacon.authors_config import check_built_on, config_from_authors
from .adapters.beacon.weights import AUTHORS_TENSOR, authors_tensor_shape
from .base_config import BUILTIN_MODELS, check_base_code
from .config import torch_dtype
from .errors import ConfigError, DataError, ModelSourceError
from .files import (
    check_model_source,
    check_output_folder,
    hub_preflight,
    is_local,
    is_whole_model,
    local_adapter_dir,
    written_atomically,
)
from .loading import load, load_tokenizer, pin_base_revision, resolve_base
from .reading import read_json_object, read_safetensors
from .spec import SPEC_FILENAME, ContextSpec, base_reference, run_outputs

EVAL_RESULTS_FILENAME = "eval_results.json"
SERVING_DOCS = "docs/recipes.md#serving-engines"
LORA_FILES = ("adapter_config.json", "adapter_model.safetensors")


def merge(
    adapter_dir: str | Path,
    out_dir: str | Path,
    base: str | Path | None = None,
    dtype: str = "float32",
    verify: bool = True,
    without: tuple[str, ...] = (),
    card: bool = False,
    base_id: str | None = None,
) -> dict[str, Any]:
    """Merge an adapter into its unquantized base loaded in ``dtype``, without the inference-time methods ``without``
    names, and save the model atomically with its methods' files, tokenizer, generation config, longpeft.json, eval
    results and (``card``) model card. ``base_id`` names the base there (else a local base is named relative to
    ``out_dir``, left out of the card). Returns ``{"out_dir", "max_abs_logit_diff", "left_out"}`` (the difference
    None unless ``verify``)."""
    if base_id:
        check_repo_id(base_id, "--base-id")
    adapter_dir, out_dir = local_adapter_dir(adapter_dir), Path(out_dir).resolve()  # "." has no name to rename to
    spec = ContextSpec.load(adapter_dir)
    if card and not base_id:
        consequence = "the exported card leaves it out (longpeft.json names it relative to the export folder)"
        warn_unnamed_base(spec, adapter_dir, consequence, "export(..., base_id=...)")
    check_merge(spec, adapter_dir, out_dir, base, without)
    model = load(base, adapter_dir, dtype=torch_dtype(dtype)).eval()
    for name in without:
        METHODS[name].remove(model)
    ids = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the largest logit difference the merge made on 32 fixed token ids
        reference = model(ids).logits.float() if verify else None
        merged = (model.merge_and_unload() if hasattr(model, "merge_and_unload") else model).eval()
        diff = (merged(ids).logits.float() - reference).abs().max().item() if verify else None
    methods = {name: section for name, section in spec.methods.items() if name not in without}
    base_model = base_id or spec.base_model
    if not base_id and base_model and not shareable_base(base_model):  # a local folder: named relative to out_dir
        base_model = base_reference(resolve_base(spec, adapter_dir, None), out_dir)
    kept = spec.model_copy(update={"methods": methods, "weights": "merged", "base_model": base_model})
    needed = sum(t.numel() * t.element_size() for t in merged.state_dict().values())
    with written_atomically(out_dir, needed) as partial:  # a full disk: one OutputWriteError naming out_dir
        merged.config.name_or_path = str(out_dir)
        merged.save_pretrained(partial)
        export_methods(merged, kept, partial)
        load_tokenizer(adapter_dir, base, trust_remote_code=False).save_pretrained(partial)
        if (adapter_dir / "generation_config.json").is_file():
            GenerationConfig.from_pretrained(adapter_dir).save_pretrained(partial)
        kept.save(partial)
        _copy_eval_results(adapter_dir, partial)
        if card:
            write_model_card(partial, kept, folder_name=out_dir.name)
    return {"out_dir": str(out_dir), "max_abs_logit_diff": diff, "left_out": list(without)}


def check_merge(
    spec: ContextSpec, adapter_dir: Path, out_dir: Path, base: str | Path | None, without: tuple[str, ...]
) -> None:
    """Refuse a merge before any weight loads: an output folder over the adapter or the base; a base that is
    missing, runs its own code or is saved quantized; ``without`` naming a method the adapter lacks or trained."""
    base_name = resolve_base(spec, adapter_dir, base)
    check_output_folder(out_dir, protected={"the adapter": adapter_dir, "the base model": Path(base_name)})
    check_model_source(base_name, "base model", "; give the base model with --base (merge(..., base=...))")
    if unknown := sorted(set(without) - set(spec.methods)):
        raise ConfigError(
            f"--without {', '.join(unknown)}: the adapter has no such method (it has {', '.join(spec.methods)})"
        )
    if trained := [name for name in without if not METHODS[name].inference_only]:
        optional = [name for name, method in METHODS.items() if method.inference_only]
        raise ConfigError(
            f"--without {trained[0]}: the adapter was trained with it, so the merged model cannot leave "
            f"it out; only inference-time methods ({', '.join(optional)}) can be"
        )
    revision = pin_base_revision(spec, base_name, {}).get("revision")
    check_base_code(base_name, revision, trusted=False, setting=None)
    quantization = getattr(AutoConfig.from_pretrained(base_name, revision=revision), "quantization_config", None)
    if quantization:
        raise ConfigError(
            f"the base {base_name} is saved quantized ({dict(quantization).get('quant_method', '?')}): "
            "a merge needs the full-precision base; pass it with --base"
        )


def export(
    adapter_dir: str | Path,
    out_dir: str | Path,
    base: str | Path | None = None,
    dtype: str = "bfloat16",
    verify: bool = True,
    without: tuple[str, ...] = (),
    base_id: str | None = None,
) -> dict[str, Any]:
    """:func:`merge` in ``dtype`` with a model card (a local base without ``base_id`` is warned about)."""
    return merge(adapter_dir, out_dir, base, dtype, verify, without, True, base_id)


def serving_note(folder: str | Path) -> str:
    """One paragraph on what a merged or exported ``folder`` needs to be served: nothing (RoPE and context length
    in config.json, read by serving engines and GGUF conversion), or ``trust_remote_code`` (transformers only)."""
    folder = Path(folder)
    spec = ContextSpec.load(folder)
    remote = [name for name in spec.methods if name in METHODS and METHODS[name].remote_code]
    if not remote:
        return (
            f"{folder} is a plain transformers model (no trust_remote_code): its RoPE base and context length "
            f"({spec.max_position_embeddings} positions) are in config.json, where vLLM, SGLang and llama.cpp's "
            f"convert_hf_to_gguf.py read them ({SERVING_DOCS})."
        )
    config = json.loads((folder / "config.json").read_text())
    files = ", ".join(sorted(path.name for path in folder.glob("modeling_*.py")))
    trained = [name for name in remote if not METHODS[name].inference_only]
    fix = (
        f"; {', '.join(trained)} is part of the trained model, so there is no plain export of it"
        if trained
        else f"; for a plain model pass --without {' --without '.join(remote)}"
    )
    return (
        f"{folder} needs trust_remote_code=True: {', '.join(remote)} run in its own modeling file ({files}, "
        f"architecture {(config.get('architectures') or ['?'])[0]}). It loads with transformers; it does not "
        "convert to GGUF (llama.cpp's converter does not know that architecture) and engines that run their own "
        f"model code (vLLM, SGLang, llama.cpp) have no {', '.join(remote)}{fix} ({SERVING_DOCS})."
    )


def _copy_eval_results(source: Path, dest: Path) -> None:
    for folder in (source, source.parent):
        if (folder / EVAL_RESULTS_FILENAME).is_file():
            shutil.copy(folder / EVAL_RESULTS_FILENAME, dest / EVAL_RESULTS_FILENAME)
            return


def check_repo_id(value: str, flag: str) -> None:
    """Raise a ConfigError naming ``flag`` unless ``value`` is a valid Hub repo id (``owner/name``)."""
    try:
        validate_repo_id(value)
    except HFValidationError as error:
        raise ConfigError(
            f"{flag} {value!r} is not a Hub repo id ({str(error).splitlines()[0]}); give owner/name"
        ) from None


def shareable_base(base_model: str | None) -> bool:
    """Whether a card may name ``base_model``: a Hub id or a built-in model, not a local path."""
    return bool(base_model) and (base_model in BUILTIN_MODELS or not is_local(base_model))


def warn_unnamed_base(spec: ContextSpec, source: Path, consequence: str, python_call: str) -> None:
    """Warn that a folder written from ``source`` for others has no Hub id for its base (``consequence``: so what)."""
    if shareable_base(spec.base_model):
        return
    named = f"by a local path ({spec.base_model!r})" if spec.base_model else "by no name"
    warnings.warn(
        f"{source / SPEC_FILENAME} names its base model {named}: {consequence}, as users would not have that "
        f"folder; pass the base's Hub id with --base-id owner/name ({python_call})",
        stacklevel=3,
    )


def plain_peft_misses(spec: ContextSpec) -> list[str]:
    """What plain ``PeftModel.from_pretrained`` on the stock base leaves out of an adapter with this spec: the RoPE
    change, the positions and every other method applied at load; empty when the weights are all it changes."""
    missed = []
    before, after = spec.original_rope_parameters, spec.rope_parameters
    if before != after:
        changed = sorted(key for key in {*before, *after} if before.get(key) != after.get(key))
        changes = ", ".join(f"{key} {before.get(key)} -> {after.get(key)}" for key in changed)
        missed.append(f"the RoPE parameters ({changes})")
    if spec.max_position_embeddings != spec.original_max_position_embeddings:
        missed.append(
            f"max_position_embeddings {spec.original_max_position_embeddings} -> {spec.max_position_embeddings}"
        )
    missed += [method.name for method, _ in spec_methods(spec) if method.changes_model and not method.implied]
    return missed


def model_card_text(
    spec: ContextSpec, eval_rows: list[dict[str, Any]], repo_id: str | None = None, folder_name: str = "model"
) -> str:
    """README.md of what ``spec.weights`` says the folder holds (LoRA when unknown): YAML metadata, what changed,
    how to load it (from ``repo_id``, else from a marked placeholder ``path/to/<folder_name>``), the eval table."""
    weights, base = spec.weights or "lora", spec.base_model
    name = (Path(base).name if is_local(base) else base) if base else "the base model"  # a local one by its folder
    full = weights == "full"
    metadata = yaml.safe_dump(card_metadata(spec, weights), sort_keys=False).strip()
    title = f"# {name} {'fully fine-tuned' if full else 'extended'} with longpeft ({spec.method})"
    lines = ["---", metadata, "---", "", title, ""]
    if full:
        lines += [
            f"A full fine-tune (longpeft `finetune: full`): every weight of {name} was trained, so this is the whole "
            "model, not an adapter; it loads with transformers alone, without longpeft or the base model.",
            "",
        ]
    lines += what_changed(spec)
    remote = any(method.remote_code for method, _ in spec_methods(spec))  # a method ships a modeling file
    lines += ["", "## Load", "", "```python", *load_snippet(spec, weights, remote, repo_id, folder_name), "```", ""]
    lines += loading_notes(spec, weights, remote)
    if eval_rows:
        lines += ["## Evaluation", "", "| task | setting | length | score |", "|---|---|---|---|"]
        lines += [
            f"| {r['task']} | {r.get('setting', '')} | {r.get('length', '')} | {r['score']:.3f} |" for r in eval_rows
        ]
        lines.append("")
    return "\n".join(lines)


def card_metadata(spec: ContextSpec, weights: str) -> dict[str, Any]:
    """A card's YAML metadata: shareable base, library, tags (the methods but the implied ones), longpeft's record."""
    methods = spec_methods(spec)
    library = {"lora": "peft", "full": "transformers", "merged": "transformers"}.get(weights)  # none loads "method"
    named = dict.fromkeys([spec.method, *(m.name for m, _ in methods if not m.implied)])
    return {
        **({"base_model": spec.base_model} if shareable_base(spec.base_model) else {}),
        **({"library_name": library} if library else {}),
        "tags": ["longpeft", "long-context", *named, *{"full": ["full-finetune"], "lora": ["lora"]}.get(weights, [])],
        "longpeft": {
            "method": spec.method,
            "rope_theta": spec.rope_parameters.get("rope_theta"),
            "rope_type": spec.rope_parameters.get("rope_type", "default"),
            "original_rope_theta": spec.original_rope_parameters.get("rope_theta"),
            "trained_length": spec.trained_length,
            "target_length": spec.target_length,
            "max_position_embeddings": spec.max_position_embeddings,
            "methods": {m.name: config.model_dump(exclude_none=True) for m, config in methods},
        },
    }


def what_changed(spec: ContextSpec) -> list[str]:
    """A card's sentences on the change: positions and lengths, RoPE parameters, each method's ``describe``."""
    lengths = [f"trained at {spec.trained_length} tokens"] if spec.trained_length else []
    lengths += [f"target {spec.target_length}"] if spec.target_length else []
    said = f" ({', '.join(lengths)})" if lengths else ""
    before, after = spec.original_max_position_embeddings, spec.max_position_embeddings
    lines = [
        f"Context extended from {before} to {after} positions{said}."
        if before != after  # else a method that reads past the window without new positions (beacon, STRING)
        else f"Positions unchanged at {after}{said}; the methods below extend what the model reads."
    ]
    if spec.rope_parameters != spec.original_rope_parameters:
        lines.append(f"RoPE: {spec.original_rope_parameters} -> {spec.rope_parameters}.")
    for method, config in spec_methods(spec):
        lines += method.describe(config)
    return lines


def load_snippet(spec: ContextSpec, weights: str, remote: bool, repo_id: str | None, folder_name: str) -> list[str]:
    """A card's Python lines that load the folder: transformers for a whole model, else ``longpeft.load``."""
    location = repo_id or f"path/to/{folder_name}"  # never a path of this machine
    where = "" if repo_id else f"{location}: where this folder is"
    if weights in ("full", "merged"):
        trust = ", trust_remote_code=True" if remote else ""  # the tokenizer reads the same auto_map: no prompt
        return [
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            f'model = AutoModelForCausalLM.from_pretrained("{location}"{trust})' + (f"  # {where}" if where else ""),
            f'tokenizer = AutoTokenizer.from_pretrained("{location}"{trust})',
        ]
    if shareable_base(spec.base_model):
        base, notes = f'"{spec.base_model}"', []
    elif spec.base_model:  # a local folder, named relative to this one
        base, notes = "None", [f"None: the base longpeft.json names ({spec.base_model} from this folder)"]
    else:
        base, notes = '"BASE_MODEL"', ["BASE_MODEL: the Hub id or folder of the base model this was trained on"]
    notes += [where] if where else []
    return [
        "import longpeft  # applies longpeft.json (RoPE base, ...) before the adapter's weights",
        f'model = longpeft.load({base}, "{location}")' + (f"  # {'; '.join(notes)}" if notes else ""),
    ]


def loading_notes(spec: ContextSpec, weights: str, remote: bool) -> list[str]:
    """A card's paragraph after the snippet: what ``trust_remote_code`` runs, what plain peft leaves out of a LoRA
    adapter (or that it leaves nothing out), or that a method-only adapter needs longpeft."""
    if weights in ("full", "merged") and remote:
        note = (
            "`trust_remote_code=True` runs the modeling file shipped here (written by longpeft, it imports only torch "
            "and transformers); without it loading fails rather than giving a model without the method."
        )
    elif weights == "lora" and (missed := plain_peft_misses(spec)):
        note = (
            "The adapter is in peft's own format, but plain `PeftModel.from_pretrained` on the stock base reads "
            f"only its weights, not `longpeft.json`, and leaves out: {'; '.join(missed)}. It then silently gives a "
            "model other than the one trained: use `longpeft.load`."
        )
    elif weights == "lora":
        note = (
            "The adapter is in peft's own format, and changes nothing besides its weights: plain "
            "`PeftModel.from_pretrained` on the stock base gives the same model as `longpeft.load`."
        )
    elif weights == "method":
        note = (
            f"This adapter has no LoRA weights (the base model's weights are unchanged), only {spec.method}'s own "
            "weights: `longpeft.load` adds them to the base and applies `longpeft.json`; neither peft nor plain "
            "transformers loads it."
        )
    else:
        note = None
    return [note, ""] if note else []


def write_model_card(
    folder: str | Path, spec: ContextSpec, repo_id: str | None = None, folder_name: str | None = None
) -> Path:
    """Write ``folder``'s README.md (:func:`model_card_text` of :func:`folder_weights`, with its eval rows) and
    return its path. ``folder_name`` (default ``folder``'s name) is the placeholder's when there is no ``repo_id``."""
    folder = Path(folder)
    spec = spec.model_copy(update={"weights": folder_weights(folder, spec)})
    results = folder / EVAL_RESULTS_FILENAME  # {"rows": [{"task", "setting", "length", "score"}, ...]}
    rows = json.loads(results.read_text()).get("rows", []) if results.is_file() else []
    for row in rows:
        if missing := {"task", "score"} - set(row):
            raise DataError(f"{results}: a row lacks {sorted(missing)}: {row}")
    path = folder / "README.md"
    path.write_text(model_card_text(spec, rows, repo_id, folder_name or folder.name))
    return path


def folder_weights(folder: Path, spec: ContextSpec) -> str:
    """What a longpeft folder's weights are: ``spec.weights`` when recorded, else LoRA (adapter_config.json) or a
    method's own; a DataError for a whole model whose longpeft.json does not say which."""
    if spec.weights:
        return spec.weights
    if (folder / "adapter_config.json").is_file():
        return "lora"
    if not is_whole_model(folder):
        return "method"
    raise DataError(
        f"{folder / SPEC_FILENAME} does not record what this whole model is (weights: full or merged); "
        "write it with longpeft (merge, export, or a finetune: full run), or set weights in that file"
    )


def check_adapter_files(folder: Path) -> None:
    """A ModelSourceError unless ``folder`` has longpeft.json and LoRA's two files or a method's ``*.safetensors``."""
    lora = [name for name in LORA_FILES if (folder / name).is_file()]
    missing = [name for name in LORA_FILES if name not in lora] if lora else []
    if not (folder / SPEC_FILENAME).is_file():
        missing.append(SPEC_FILENAME)
    if not lora and not any(folder.glob("*.safetensors")):
        missing.append("weights (adapter_model.safetensors or a method's own *.safetensors)")
    if missing:
        raise ModelSourceError(f"{folder} lacks {missing}; is it an adapter folder written by longpeft train?")


def _copy_files(source: Path, dest: Path, skip: tuple[str, ...] = ()) -> None:
    """Copy the files of ``source`` (not its subfolders, nor its card: the staged folder gets its own) to ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and item.name != "README.md" and item.name not in skip:
            shutil.copy(item, dest / item.name)


def _update_json(path: Path, changes: dict[str, Any]) -> None:
    """Set ``changes`` in the JSON object of ``path``."""
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}, indent=2, sort_keys=True) + "\n")


def stage_whole_model(source: Path, dest: Path, dtype: str) -> None:
    """Copy a whole model to ``dest``, its float weights cast to ``dtype`` file by file; a ModelSourceError if none."""
    if not (weights := sorted(source.glob("*.safetensors"))):
        raise ModelSourceError(
            f"{source} holds config.json but no *.safetensors weights; is it the model/ folder "
            "of a longpeft run with finetune: full?"
        )
    target = torch_dtype(dtype)
    _copy_files(source, dest, skip=tuple(path.name for path in weights))
    sizes = {}
    for path in weights:
        tensors = {key: t.to(target) if t.is_floating_point() else t for key, t in read_safetensors(path).items()}
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
        save_file(tensors, dest / path.name, metadata=metadata)
        sizes[path.name] = sum(t.numel() * t.element_size() for t in tensors.values())
    # use_cache: a model saved by an older longpeft's training run has it off
    _update_json(dest / "config.json", {"dtype": dtype, "use_cache": True})
    for index_path in dest.glob("*.safetensors.index.json"):  # sharded weights: the index records their size
        index = json.loads(index_path.read_text())
        index.setdefault("metadata", {})["total_size"] = sum(sizes[name] for name in set(index["weight_map"].values()))
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def name_base_in_adapter_config(folder: Path, base_model: str | None) -> None:
    """Name the base in ``folder``'s adapter_config.json (if any) as longpeft.json does, not by peft's load path."""
    config_path = folder / "adapter_config.json"
    if config_path.is_file():
        _update_json(config_path, {"base_model_name_or_path": base_model})


def push(
    source: str | Path,
    repo_id: str,
    merged: bool = False,
    dtype: str = "bfloat16",
    private: bool = False,
    dry_run: str | Path | None = None,
    base_id: str | None = None,
    base: str | Path | None = None,
) -> str:
    """Make ``repo_id``'s files exactly a folder written from ``source`` (an adapter, a whole model or a run folder
    holding one): an adapter in peft's format, or (``merged``) merged into ``base`` in ``dtype``, or a whole model cast
    to ``dtype``; the base named by ``base_id``, else longpeft.json's Hub id or built-in name, never a local folder
    (warned). Returns the commit URL (token: the environment's or ``huggingface-cli login``'s), or with ``dry_run``
    the folder written there (nothing uploaded)."""
    if dry_run is None:
        with contextlib.suppress(FileNotFoundError):  # a new repository: create_repo makes it
            hub_preflight(repo_id, "push to")
    check_repo_id(repo_id, "--repo")
    if base_id:
        check_repo_id(base_id, "--base-id")
    found = run_outputs(source)  # a run folder: upload its adapter/ or model/ (finetune: full)
    if len(found) > 1:
        raise ConfigError(
            f"{source} holds both {found[0].name}/ and {found[1].name}/ (runs with different finetune "
            "settings wrote there); push the one you mean: " + " or ".join(map(str, found))
        )
    source = found[0] if found else Path(source)
    spec = ContextSpec.load(source)  # fails clearly when this is not a longpeft folder
    if not base_id:
        warn_unnamed_base(spec, source, "the uploaded card and longpeft.json leave it out", "push(..., base_id=...)")
        base_id = spec.base_model if shareable_base(spec.base_model) else None
    with tempfile.TemporaryDirectory() as staging:
        folder = Path(dry_run if dry_run is not None else Path(staging) / "upload").resolve()
        check_output_folder(folder, protected={"the folder to upload": source}, flag="--dry-run")
        weights = folder_weights(source, spec)
        with written_atomically(folder) as partial:
            if weights in ("full", "merged"):
                stage_whole_model(source, partial, dtype)
            elif merged:
                merge(source, partial, base=base, dtype=dtype)
                weights = "merged"
            else:
                check_adapter_files(source)
                _copy_files(source, partial)
                write_tied_copies(partial, tied_names(partial))  # peft's own format, whatever wrote the folder
            _copy_eval_results(source, partial)
            staged = ContextSpec.load(partial)
            staged.weights = weights
            staged.base_model = base_id  # by its Hub id, never by a path of this machine
            staged.save(partial)
            name_base_in_adapter_config(partial, base_id)
            write_model_card(partial, staged, repo_id=repo_id)
        if dry_run is not None:
            return str(folder)
        api = HfApi()
        api.create_repo(repo_id, private=private or None, exist_ok=True)  # None: the account's default visibility
        if private:  # create_repo leaves an existing repository's visibility as it was
            api.update_repo_settings(repo_id, private=True)
        # delete_patterns: no file of an earlier push stays (a stale adapter_config.json would make it an adapter)
        info = api.upload_folder(
            repo_id=repo_id, folder_path=str(folder), commit_message="Upload longpeft model", delete_patterns=["*"]
        )
        return str(info)


def _checkpoint_files(source: str | Path) -> tuple[Path, dict[str, Any], list[Path]]:
    """(folder, config.json, the safetensors files that hold beacon tensors) of a local folder or Hub repo (whose
    config and index are downloaded, then the files the index names, or ``model.safetensors``)."""
    local = Path(source).is_dir()
    patterns = ["config.json", "*.safetensors.index.json"]
    folder = Path(source if local else snapshot_download(str(source), allow_patterns=patterns))
    if (index := next(iter(folder.glob("*.safetensors.index.json")), None)) is not None:
        weight_map = read_json_object(index, "safetensors index").get("weight_map")  # tensor -> file
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise DataError(f"{index}: no weight_map of tensor names to file names; download the model again")
        names = sorted({f for k, f in weight_map.items() if AUTHORS_TENSOR.match(k)})
    else:
        names = [path.name for path in sorted(folder.glob("*.safetensors"))] if local else ["model.safetensors"]
    files = [folder / name if local else Path(hf_hub_download(str(source), name)) for name in names]
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelSourceError(f"{source}: no config.json; give the folder (or Hub id) of an Activation Beacon model")
    return folder, read_json_object(config_path, "the authors' config"), files


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
        if bad := int((~torch.isfinite(tensor)).sum()):
            raise DataError(
                f"{path}: {name} holds {bad} NaN or infinite values; the checkpoint is damaged: download it again"
            )


def convert_authors_beacon(source: str | Path, out_dir: str | Path, base: str | Path) -> dict[str, Any]:
    """Write into ``out_dir`` a beacon adapter for ``longpeft.load(base, out_dir)`` from the authors' Activation Beacon
    model ``source`` (a folder or Hub id, e.g. ``namespace-Pt/beacon-qwen-2-7b-instruct``) built on ``base``: its
    ``beacon_*`` settings and tensors only, no remote code run. Returns ``{"out_dir", "tensors", "beacon"}``."""
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
    layers = range(base_config.num_hidden_layers)
    expected = {f"model.layers.{i}.self_attn.beacon_{p}_proj.weight" for i in layers for p in beacon.params}
    if missing := sorted((expected | {"model.beacon_embed_tokens.weight"}) - set(tensors)):
        raise DataError(
            f"{source} lacks beacon tensors {missing[:4]} (beacon_param in {config_file} says {beacon.params})"
        )
    projections = {name.split(".")[-2][len("beacon_")] for name in tensors if name.endswith("_proj.weight")}
    if unlisted := sorted(projections - set(beacon.params)):  # the layer count is the base's (check_built_on)
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
