"""The whole `longpeft synth` run: config, sources, builders, mixing, outputs (the files it writes: docs/synth.md)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from datasets import Dataset
from pydantic import Field, create_model, model_validator
from transformers import PreTrainedTokenizerBase

from ..config import StrictModel
from ..errors import ConfigError, DataError
from ..files import write_text_atomically
from .builders import DEFAULT_CONTEXT_TEMPLATE, ContextPlan, LengthConfig, LongContextBuilder
from .corpus import Document
from .llm_client import LLMClient
from .llm_request import LLMConfig
from .mix import MixConfig, load_mix_sources, mix, text_records
from .qa import LLMAnswerer, ProceduralAnswerer
from .quality import QualityConfig, QualityGates
from .registry import TASKS, QAGenerator, TaskConfig
from .report import write_dataset

if TYPE_CHECKING:
    SynthConfig = StrictModel  # at run time the model of synth_config_model(), served by __getattr__ below

CACHE_DIR = "llm_cache"
REJECTS_FILE = "rejects.jsonl"
CONFIG_FILE = "config.json"


class SourceConfig(StrictModel):
    kind: Literal["procedural", "files"] = Field("procedural", description="generated documents, or your files")
    paths: list[str] = Field(default_factory=list, description=".txt (one document each) / .jsonl ('text', 'title')")


class _BeforeTasks(StrictModel):
    """The fields of :data:`SynthConfig` before the task sections (``config.json`` keeps this order)."""

    seed: int = 0
    tokenizer: str = Field("tiny", description="Hub id or folder of the training tokenizer, or 'tiny' (in memory)")
    answerer: Literal["procedural", "llm"] = Field("procedural", description="exact offline QA, or an LLM")
    source: SourceConfig = Field(default_factory=SourceConfig)
    length: LengthConfig = Field(default_factory=LengthConfig)

    @model_validator(mode="after")
    def _consistent(self) -> _BeforeTasks:
        if self.source.kind == "files" and not self.source.paths:
            raise ValueError("source.kind 'files' needs source.paths (your documents; --source PATH ...)")
        if self.source.kind == "files" and self.answerer == "procedural":
            raise ValueError("the procedural answerer needs procedural documents; use answerer: llm with your files")
        return self


class _AfterTasks(StrictModel):
    """The fields of :data:`SynthConfig` after the task sections."""

    mix: MixConfig = Field(default_factory=MixConfig)
    llm: LLMConfig = Field(default_factory=LLMConfig)
    quality: QualityConfig = Field(
        default_factory=QualityConfig, description="quality gates on LLM-written items (docs/synth.md)"
    )
    context_template: str = DEFAULT_CONTEXT_TEMPLATE
    progress: bool = True


@functools.cache
def _config_model(sections: tuple[tuple[str, type[TaskConfig]], ...]) -> type[StrictModel]:
    taken = sorted(name for name, _ in sections if name in {*_BeforeTasks.model_fields, *_AfterTasks.model_fields})
    if taken:
        raise ConfigError(f"synth task(s) {taken} bear the name of a synth config field; rename the task")
    tasks = create_model(
        "SynthTasks", __base__=StrictModel, **{name: (model, Field(default_factory=model)) for name, model in sections}
    )
    doc = "Everything a `longpeft synth` run needs (YAML/JSON file, overridden by command-line flags)"
    return create_model("SynthConfig", __base__=(_AfterTasks, tasks, _BeforeTasks), __doc__=doc)


def synth_config_model() -> type[StrictModel]:
    """:data:`SynthConfig`: the config model of the tasks registered now (one model per set of tasks)."""
    return _config_model(tuple((task.name, task.config) for task in TASKS.values()))


def __getattr__(name: str) -> Any:
    if name == "SynthConfig":  # read at each use: a task registered later has its section
        return synth_config_model()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The training tokenizer (``--tokenizer``): a local folder, a Hub id that answers within ``LONGPEFT_HUB_TIMEOUT``
    (:func:`~longpeft.files.check_model_source`), or ``"tiny"``, longpeft's in-memory tokenizer."""
    if name == "tiny":
        from ..tiny import demo_tokenizer

        return demo_tokenizer()
    from transformers import AutoTokenizer

    from ..files import check_model_source

    check_model_source(name, "tokenizer (--tokenizer)", "; give a tokenizer's folder, a Hub id owner/name, or tiny")
    return AutoTokenizer.from_pretrained(name, use_fast=True)


def load_documents(paths: list[str]) -> list[Document]:
    """Documents from .txt files (one per file, titled by the file name) and .jsonl files (``text``, optional
    ``title``/``id``); folders are searched for both, a named file of another type is refused."""
    kinds = {".txt": "one document per file", ".jsonl": "one JSON record with a 'text' field per line"}
    documents = []
    for file, number, record in (row for raw in paths for row in text_records(raw, kinds, "source path", "document")):
        if number is None:  # a .txt file, titled by its name
            doc_id, title = str(file), file.stem.replace("_", " ")
        else:
            doc_id, title = str(record.get("id", f"{file}:{number}")), str(record.get("title", ""))
        documents.append(Document(doc_id=doc_id, title=title, text=record["text"]))
    if not documents:
        raise DataError(f"no documents found in {paths}")
    return documents


@dataclass
class SynthInputs:
    """Every input file of a run, read and checked: your ``documents`` (``None`` for procedural ones) and the
    candidate conversations of each mixed-in source (:func:`.mix.load_mix_sources`)."""

    documents: list[Document] | None
    mix_sources: dict[str, list[list[dict[str, str]]]]


def read_inputs(config: SynthConfig) -> SynthInputs:
    """Read and check every input file ``config`` names before any long work (the run and ``synth --plan``), naming
    the file (and line), the key and its flag in an error."""
    documents = load_documents(config.source.paths) if config.source.kind == "files" else None
    return SynthInputs(documents, load_mix_sources(config.mix))


def synthesize(
    config: SynthConfig,
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    retry_rejected: bool = False,
) -> tuple[Dataset, dict[str, Any]]:
    """Run the builders and mixing described by ``config``, write the outputs, return (dataset, stats);
    ``retry_rejected`` asks again the requests an earlier run into ``out_dir`` rejected (else skipped and counted)."""
    inputs = read_inputs(config)  # bad input files fail first
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)  # and a bad tokenizer too
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(out / CONFIG_FILE, config.model_dump_json(indent=2) + "\n")
    answerer: QAGenerator = ProceduralAnswerer()
    client, gates = None, QualityGates(config.quality)
    if config.answerer == "llm":
        client = LLMClient(
            config.llm, out / CACHE_DIR, out / REJECTS_FILE, config.progress, retry_rejected=retry_rejected
        )
        answerer = LLMAnswerer(client, gates)
    builder, plans = plan_contexts(config, tokenizer, answerer, inputs.documents)
    rows = builder.build(plans)
    rows, mix_stats = mix(rows, builder.counter, config.mix, config.seed, inputs.mix_sources)
    extra: dict[str, Any] = {"build": builder.report.to_dict(), "mix": mix_stats}
    if client is not None:
        client.rejects.finish()  # the file is now this build's state: the summary reports it
        extra.update(llm_usage=client.usage_report(), rejects=client.rejects.counts(), quality=gates.report())
    return write_dataset(rows, out, extra), json.loads((out / "stats.json").read_text(encoding="utf-8"))


def plan_contexts(
    config: SynthConfig, tokenizer: PreTrainedTokenizerBase, answerer: QAGenerator, files: list[Document] | None
) -> tuple[LongContextBuilder, list[ContextPlan]]:
    """The run's builder (with ``answerer``) and every conversation's context and QA jobs, task by task in the
    registry's order (no QA is generated yet), from ``files`` or, when None, from procedural documents."""
    builder = LongContextBuilder(
        tokenizer, answerer, config.length, config.context_template, config.seed, show_progress=config.progress
    )
    plans = []
    for name in TASKS:
        if (settings := getattr(config, name)).contexts:
            plans += builder.plan(name, files, **dict(settings))
    return builder, plans
