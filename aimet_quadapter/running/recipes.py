"""Experiment recipes: YAML files of a run's model, data, settings and methods, checked before anything heavy starts.

``--set key.path=value`` overrides a field (parsed as YAML); ``base: other.yaml`` (relative to the file) starts from
another recipe, this file's values winning. A relative dataset path is looked up in each folder of
``AIMET_QUADAPTER_DATA`` (``os.pathsep``-separated), in ``data_dirs``, next to the recipe file, then in the current
directory; a ``./`` or ``../`` model folder, ``data_dirs`` and ``base`` are relative to the file that names them.
"""

from __future__ import annotations

import difflib
import os
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError

from aimet_quadapter.errors import QuadapterError
from aimet_quadapter.export.formats import SEQ_LEN as EXPORT_SEQ_LEN
from aimet_quadapter.methods.catalog import CATALOG
from aimet_quadapter.methods.generated import GenerationParameters
from aimet_quadapter.models.devices import DEVICE_CHOICES, DEVICE_PATTERN
from aimet_quadapter.quadapter.config import (
    AdapterParameters,
    Phase1Parameters,
    Phase2Parameters,
    QuadapterParameters,
    RunOptions,
)
from aimet_quadapter.quant.config import BaselineParameters, QuantPolicy
from aimet_quadapter.settings import Settings, result_view, validating_a_schema
from aimet_quadapter.text import EVAL_SEQ_LEN

DATA_ENV = "AIMET_QUADAPTER_DATA"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def parameter_sections() -> list[tuple[str, type[Settings]]]:
    """(recipe section, its parameter class): what the schema, the command-line options and the fingerprints read."""
    return [
        ("policy", QuantPolicy),
        ("quadapter", AdapterParameters),  # phase1 and phase2 are sections of their own
        ("phase1", Phase1Parameters),
        ("phase2", Phase2Parameters),
        ("execution", RunOptions),
        ("baselines", BaselineParameters),
        ("generated", GenerationParameters),
    ]


def result_section(section: str, values: dict) -> dict:
    """A recipe section's values less the fields that change no result, as fingerprints and ``merge`` compare."""
    sources = dict(parameter_sections())
    return result_view(sources[section], values) if section in sources else values


def _known_method(name: str) -> str:
    if name not in CATALOG:
        raise ValueError(f"unknown method {name!r}; known: {', '.join(CATALOG)}")
    return name


def _device_name(name: str) -> str:
    if not re.match(DEVICE_PATTERN, name):
        raise ValueError(f"{name!r} is not a device: {DEVICE_CHOICES}")
    return name


DeviceName = Annotated[str, AfterValidator(_device_name)]
DatasetGroup = Annotated[list[str], BeforeValidator(lambda v: [v] if isinstance(v, str) else v), Field(min_length=1)]
MethodName = Annotated[str, AfterValidator(_known_method)]


class QuadapterSection(AdapterParameters):
    # held-out crops by whose LM loss phase 1 keeps its best point (0: no check; too few make it a coin toss)
    holdout: int = Field(8, ge=0)


class CalibrationSection(_Section):
    samples: int = Field(10, ge=1)
    length: int = Field(512, ge=2)
    seed: int = 0
    # None: each F-ID's train split calibrates that F-ID's cells; a dataset (or list): one set for the whole matrix
    dataset: DatasetGroup | None = None


class EvalDataset(_Section):
    name: str
    label: str | None = None  # column name; default: the corpus name or the file/folder name
    split: Literal["train", "valid", "test"] | None = None
    max_tokens: int | None = Field(None, ge=2)
    seq_len: int | None = Field(None, ge=2)
    stride: int | None = Field(None, ge=1)
    # tokens of the split skipped before the first window, e.g. development text after what the evaluation reads
    start: int = Field(0, ge=0)


def _as_dataset(value: Any) -> Any:
    return {"name": value} if isinstance(value, str) else value


class EvalSection(_Section):
    datasets: list[Annotated[EvalDataset, BeforeValidator(_as_dataset)]] = Field(min_length=1)
    split: Literal["train", "valid", "test"] = "test"
    max_tokens: int | None = Field(None, ge=2)
    # null: the longest window the model takes after the prefix, at most EVAL_SEQ_LEN (a recipe for any model)
    seq_len: int | None = Field(EVAL_SEQ_LEN, ge=2)
    stride: int | None = Field(None, ge=1)


class DevSection(EvalSection):
    """Development text: scored like the evaluation texts, in a table of its own, for choosing settings."""

    split: Literal["train", "valid", "test"] = "valid"


# answered greedily by the FP model and by the device graph: what a user would look at first
PROMPTS = ("The capital of France is", "def add(a, b):", "Once upon a time")


class ExportSection(_Section):
    """After every cell: the quantized row of the lowest geometric-mean development perplexity (mean over seeds),
    its first seed's state exported with AIMET's encodings and run in AIMET's ONNX simulation of the device graph."""

    # the rows the choice is among; default: every quantized row of the run
    candidates: list[MethodName] | None = None
    seq_len: int = Field(EXPORT_SEQ_LEN, ge=2)  # the graph's static input length
    # development text, which no evaluation reads; its train split calibrates the tensors the encodings leave out
    verify_dataset: str = "ptb"
    verify_split: Literal["train", "valid", "test"] = "valid"
    verify_windows: int = Field(4, ge=1)
    device_check: bool = True
    kv_graphs: bool = False
    prompts: list[str] = Field(default_factory=lambda: list(PROMPTS))
    new_tokens: int = Field(16, ge=1)  # each prompt's greedy answer


class Recipe(_Section):
    name: str | None = None
    description: str | None = None
    model: str
    out: str | None = None  # default run folder (relative to the current directory); --out overrides
    # where every cell computes (auto: CUDA when there is one); no fingerprint's: the same result up to float rounding
    device: DeviceName = "auto"
    data_dirs: list[str] = Field(default_factory=list)
    policy: QuantPolicy = Field(default_factory=QuantPolicy)
    calibration: CalibrationSection = Field(default_factory=CalibrationSection)
    phase1: Phase1Parameters = Field(default_factory=Phase1Parameters)
    phase2: Phase2Parameters = Field(default_factory=Phase2Parameters)
    execution: RunOptions = Field(default_factory=RunOptions)  # how they run: no cell's result depends on it
    quadapter: QuadapterSection = Field(default_factory=QuadapterSection)
    baselines: BaselineParameters = Field(default_factory=BaselineParameters)
    generated: GenerationParameters = Field(default_factory=GenerationParameters)
    methods: list[MethodName] = Field(min_length=1)
    # one F-ID per entry, a dataset or a list of them ("expanded F-ID"), whose train split fine-tunes (and calibrates)
    fid: list[DatasetGroup] = Field(default_factory=list)
    # Data-size sweep (Fig. 3): phase2.steps steps on each of these numbers of sequences, cycling through them;
    # None: fresh data every step
    finetune_sizes: list[Annotated[int, Field(ge=1)]] | None = None
    # every cell but FP32's once per seed (calibration.seed, generated.seed, phase1.seed), reported as mean and min-max
    seeds: Annotated[list[int], Field(min_length=1)] | None = None
    eval: EvalSection
    # scored for every cell, so that settings are chosen there and never on the evaluation texts (methods/roles.py)
    dev: DevSection | None = None
    # Text every sequence (the FP model's too) follows, held as a full-precision KV cache (PrefixQuant): the attention
    # sinks' outsized activations then enter no static range. E.g. "<|im_start|>\n"; `auto`: the model's own.
    prefix: str | None = Field(None, min_length=1)
    # a method whose AIMET technique refuses the model's family is replaced by the one named here (else refused)
    fallbacks: dict[MethodName, MethodName] = Field(default_factory=dict)
    export: ExportSection | None = None

    _path: Path | None = PrivateAttr(default=None)

    def quant_policy(self) -> QuantPolicy:
        return self.policy

    def quadapter_parameters(self) -> QuadapterParameters:
        q = self.quadapter
        return QuadapterParameters(phase1=self.phase1, phase2=self.phase2, init=q.init, extra_sites=q.extra_sites)

    def baseline_parameters(self) -> BaselineParameters:
        return self.baselines

    def for_seed(self, seed: int) -> Recipe:
        """This recipe with ``seed`` in every seed it has, and no ``seeds`` list: one seed's run."""
        seeded = ("calibration", "generated", "phase1")
        update = {section: getattr(self, section).model_copy(update={"seed": seed}) for section in seeded}
        return self.model_copy(update={**update, "seeds": None})  # pydantic copies the private _path

    def for_family(self, family: str | None) -> Recipe:
        """This recipe with each method AIMET refuses on ``family`` replaced by its fallback (methods, export)."""
        from aimet_quadapter.quant.llm_techniques import refusal

        def swap(method: str) -> str:
            technique = CATALOG[method].aimet
            refused = technique is not None and refusal(technique, family, self.policy) is not None
            return self.fallbacks.get(method, method) if refused else method

        methods = list(dict.fromkeys(swap(m) for m in self.methods))
        if methods == self.methods:
            return self
        update: dict[str, Any] = {"methods": methods}
        if self.export is not None and self.export.candidates:
            candidates = list(dict.fromkeys(swap(m) for m in self.export.candidates))
            update["export"] = self.export.model_copy(update={"candidates": candidates})
        return self.model_copy(update=update)

    @property
    def path(self) -> Path | None:
        return self._path

    @property
    def display_name(self) -> str:
        return self.name or (self._path.stem if self._path else "recipe")

    def where(self) -> str:
        return f"recipe {self._path}" if self._path else f"recipe {self.name}" if self.name else "recipe"

    def search_dirs(self) -> list[tuple[str, Path]]:
        """(description, folder) in the order relative dataset paths are looked up."""
        env = filter(None, os.environ.get(DATA_ENV, "").split(os.pathsep))
        dirs = [(f"${DATA_ENV}", Path(d).expanduser()) for d in env]
        base = self._path.parent if self._path else Path.cwd()
        # absolute once read from a file (relative to that file)
        dirs += [("data_dirs", (base / Path(os.path.expandvars(d)).expanduser()).resolve()) for d in self.data_dirs]
        if self._path:
            dirs.append(("the recipe's folder", base))
        dirs.append(("the current directory", Path.cwd()))
        return dirs

    def resolve_dataset(self, name: str) -> str:
        """A corpus name as is; a local path as an absolute path found as the module docstring says."""
        from aimet_quadapter.methods.generated import GENERATED
        from aimet_quadapter.text.data import ALIASES, CORPORA

        if ALIASES.get(name.lower(), name.lower()) in CORPORA or name == GENERATED:
            return name
        path = Path(os.path.expandvars(name)).expanduser()
        if path.is_absolute():
            if path.exists():
                return str(path)
            raise QuadapterError(f"{self.where()}: dataset {name!r} does not exist")
        looked = []
        for what, folder in self.search_dirs():
            candidate = (folder / path).resolve()
            if candidate.exists():
                return str(candidate)
            looked.append(f"{folder} ({what})")
        hint = "" if os.environ.get(DATA_ENV) else f"; set {DATA_ENV} to the folder that holds it"
        raise QuadapterError(
            f"{self.where()}: dataset {name!r} is neither a known corpus ({', '.join(CORPORA)}) nor found in "
            f"{'; '.join(looked)}{hint}"
        )

    def resolve_model(self) -> str:
        """The model to load; a ``./`` folder given with ``--set`` is relative to the current directory."""
        return str(Path(self.model).resolve()) if self.model.startswith(("./", "../")) else self.model


def parse_overrides(items: list[str] | None) -> list[tuple[str, Any]]:
    """``["a.b=1", "methods=[x,y]"]`` -> ``[("a.b", 1), ("methods", ["x", "y"])]``; keys checked against the schema."""
    out = []
    for item in items or []:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise QuadapterError(f"--set {item!r}: expected KEY=VALUE, e.g. --set phase2.steps=200")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as exc:
            raise QuadapterError(f"--set {key}: value {text!r} is not valid YAML ({_first_line(exc)})") from None
        _check_key(key)
        out.append((key, value))
    return out


def _elsewhere(name: str) -> list[str]:
    """``section.name`` for each parameter section with the field ``name``: where a misplaced field belongs."""
    return [f"{section}.{name}" for section, source in parameter_sections() if name in source.model_fields]


def _check_key(key: str) -> None:
    model: type[BaseModel] | None = Recipe
    done: list[str] = []
    for part in key.split("."):
        if model is None:
            raise QuadapterError(f"--set {key}: {'.'.join(done)} is a value, not a section with fields")
        fields = model.model_fields
        if part not in fields:
            where = ".".join(done) or "the recipe"
            hint = "".join(f" (did you mean {other}?)" for other in _elsewhere(part)[:1])
            raise QuadapterError(f"--set {key}: unknown field {part!r} in {where}{hint}; known: {', '.join(fields)}")
        options = [fields[part].annotation, *typing.get_args(fields[part].annotation)]  # a section or None
        model = next((a for a in options if isinstance(a, type) and issubclass(a, BaseModel)), None)
        done.append(part)


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file; any problem is a one-line :class:`QuadapterError`."""
    path = Path(path)
    raw = read_recipe_file(path)
    parsed = parse_overrides(overrides)
    for key, value in parsed:
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    recipe = validate_recipe(raw, f"recipe {path}", [k for k, _ in parsed])
    recipe._path = path.resolve()
    return recipe


def read_recipe_file(path: Path, _seen: tuple[Path, ...] = ()) -> dict:
    """The raw mapping of a recipe file over its ``base:``; paths relative to the file made absolute."""
    where = f"recipe {path}"
    if not path.is_file():
        raise QuadapterError(f"{where} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise QuadapterError(f"{where}: not valid YAML: {_first_line(exc)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise QuadapterError(f"{where}: expected a mapping of fields at the top level, got {type(raw).__name__}")
    folder = path.resolve().parent
    if isinstance(raw.get("data_dirs"), list):
        raw["data_dirs"] = [str(folder / os.path.expandvars(str(d))) for d in raw["data_dirs"]]
    if isinstance(raw.get("model"), str) and raw["model"].startswith(("./", "../")):
        raw["model"] = str((folder / raw["model"]).resolve())
    if (base := raw.pop("base", None)) is None:
        return raw
    if not isinstance(base, str):
        raise QuadapterError(f"{where}: field base: expected a file name, got {base!r}")
    base_path = (folder / base).resolve()
    if base_path in _seen:
        raise QuadapterError(f"{where}: field base: {base} includes itself")
    if not base_path.is_file():
        raise QuadapterError(f"{where}: field base: {base_path} does not exist")
    return _merge(read_recipe_file(base_path, (*_seen, path.resolve())), raw)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def validate_recipe(raw: dict, where: str = "recipe", overridden: list[str] | None = None) -> Recipe:
    try:
        with validating_a_schema():
            recipe = Recipe.model_validate(raw)
    except ValidationError as exc:
        raise QuadapterError(f"{where}: {_describe(exc, overridden or [])}") from None
    calibrated = [m for m in recipe.methods if CATALOG[m].calibrates]
    if calibrated and recipe.calibration.dataset is None and not recipe.fid:
        raise QuadapterError(
            f"{where}: field fid: {calibrated[0]} needs calibration data: give an F-ID dataset "
            f"(its train split calibrates), or set calibration.dataset"
        )
    if recipe.seeds and len(set(recipe.seeds)) < len(recipe.seeds):
        raise QuadapterError(f"{where}: field seeds: {recipe.seeds} names a seed twice")
    _check_export(recipe, where)
    tuning = [m for m in recipe.methods if CATALOG[m].finetunes]
    if tuning and not recipe.fid:
        raise QuadapterError(f"{where}: field fid: methods {', '.join(tuning)} fine-tune, so they need an F-ID dataset")
    return recipe


def _check_export(recipe: Recipe, where: str) -> None:
    if (e := recipe.export) is None:
        return
    if recipe.dev is None:
        raise QuadapterError(f"{where}: field export: the row to export is chosen on development text: add dev")
    quantized = [m for m in recipe.methods if CATALOG[m].quantized]
    for name in e.candidates or []:
        if name not in quantized:
            raise QuadapterError(
                f"{where}: field export.candidates: {name} is not a quantized method of this recipe "
                f"({', '.join(quantized) or 'none'})"
            )
    if not (e.candidates or quantized):
        raise QuadapterError(f"{where}: field export: the recipe has no quantized method to export")


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


def _describe(exc: ValidationError, overridden: list[str]) -> str:
    # A misspelt field shows up twice (unknown, and the field it meant as missing): name the misspelling.
    errors = sorted(exc.errors(), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    loc = _loc(first["loc"])
    kind, ctx = first["type"], first.get("ctx", {})
    if kind == "extra_forbidden":
        known = _fields_at(first["loc"][:-1])
        close = difflib.get_close_matches(str(first["loc"][-1]), known, n=1) or _elsewhere(str(first["loc"][-1]))
        text = "unknown field" + (f"; did you mean {close[0]}?" if close else "")
        text += f" (known: {', '.join(known)})" if known else ""
    elif kind == "missing":
        text = "required field is missing"
    elif kind in _BOUNDS:
        text = f"must be {_BOUNDS[kind]} {next(iter(ctx.values()))} (got {first['input']!r})"
    elif kind == "value_error":  # our own validators' messages already quote the value
        text = first["msg"].removeprefix("Value error, ")
    else:
        text = first["msg"][:1].lower() + first["msg"][1:] + f" (got {first['input']!r})"
    if any(loc == k or loc.startswith(k + ".") or loc.startswith(k + "[") for k in overridden):
        text += " (from --set)"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"field {loc}: {text}{more}"


def _fields_at(loc: tuple) -> list[str]:
    model: Any = Recipe
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        model = field.annotation
        args = typing.get_args(model)
        if args:  # list[...] or Annotated[...]: look inside for a model
            model = next((a for a in _flatten(args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return list(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else []


def _flatten(args: tuple) -> list:
    return [x for a in args for x in (a, *_flatten(typing.get_args(a)))]


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
