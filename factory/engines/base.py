"""What every engine is: the interface the pipeline, the card, publishing, naming and the CLI read, and the few
pieces engines share. An engine owns everything about its method (see README.md); nothing outside
factory/engines/ names a method.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from pydantic import Field, field_validator

from factory.errors import JobFailed, SpecError
from factory.settings import cpu_threads
from factory.specs import Closed, QuantSpec, bpw_tag, check_bpw, check_head_bits
from factory.vram import human

if TYPE_CHECKING:
    import torch

    from factory.checkpoints.inspection import ModelInfo
    from factory.registry.published import QuantRow
    from factory.vram import Params, Shape

Emit = Callable[[dict], None]
Logits = Callable[["torch.Tensor"], "torch.Tensor"]  # token ids [1, L] on the CPU -> logits [1, L, V]


class Targets(Closed):
    """What a recipe's key for this engine holds (`exl2: {bpw: [...], head_bits: 6}`): one or more specs."""

    def specs(self) -> list[QuantSpec]:
        raise NotImplementedError


class BpwSpec(QuantSpec):
    """A spec of bits per weight and head bits (EXL2, EXL3), in the ranges its subclass allows."""

    BPW_RANGE: ClassVar[tuple[float, float]]
    HEAD_BITS: ClassVar[tuple[int, ...]]
    bpw: float
    head_bits: int = 6

    @field_validator("bpw", mode="before")
    @classmethod
    def _bpw(cls, v: object) -> float:
        return check_bpw(v, *cls.BPW_RANGE)

    @field_validator("head_bits", mode="before")
    @classmethod
    def _head(cls, v: object) -> int:
        return check_head_bits(v, cls.HEAD_BITS)

    @property
    def tag(self) -> str:
        return bpw_tag(self.method, self.bpw, self.head_bits)

    @property
    def flag_value(self) -> str:
        return f"{self.bpw:g}"

    @property
    def bits(self) -> float:
        return self.bpw


class BpwTargets(Targets):
    """A recipe key of sizes (`bpw: [3.0, 4.0]`) and the head bits they share, for a BpwSpec (`spec_class`)."""

    spec_class: ClassVar[type[BpwSpec]]
    bpw: list[float] = Field(min_length=1)
    head_bits: int = 6

    @field_validator("bpw", mode="before")
    @classmethod
    def _bpw(cls, v: object) -> list[float]:
        return [check_bpw(b, *cls.spec_class.BPW_RANGE) for b in (v if isinstance(v, list) else [v])]

    @field_validator("head_bits", mode="before")
    @classmethod
    def _head(cls, v: object) -> int:
        return check_head_bits(v, cls.spec_class.HEAD_BITS)

    def specs(self) -> list[BpwSpec]:
        return [self.spec_class(bpw=b, head_bits=self.head_bits) for b in sorted(set(self.bpw))]


@dataclass
class QuantizeRequest:
    source_dir: Path  # the job's staging folder: the source's allowlisted files only (factory/checkpoints/files.py)
    out_dir: Path  # empty; the engine fills it with the quant's files
    work_dir: Path  # the engine's scratch space, kept between attempts
    spec: QuantSpec
    calibration: list[list[int]] = field(default_factory=list)  # token windows, for engines that take tokens
    calibration_file: Path | None = None  # the calibration text as parquet ("text"), for engines that tokenize
    measurements: dict[str, Path] = field(default_factory=dict)  # stage -> file of each of the engine's Shared units
    quants: dict[str, Path] = field(default_factory=dict)  # tag -> folder of each quant it is made from (made_from)
    model: str = "model"  # the source's name as its owner wrote it (`SmolLM2-135M-Instruct`), for file names


@dataclass(frozen=True)
class Shared:
    """A unit every target of a model shares, made once per key and reused by later jobs (`<stage>:<key>`): EXL2's
    measurement; GGUF's 16-bit conversion and its importance matrix. An engine's are made in the order it lists
    them, each after the one before, and every quantize unit of the engine waits for all of them."""

    stage: str  # the unit's name before its key, and its family in the ETA's history: `measure`, `convert`
    about: str  # as people read it: "measurement", "importance matrix"
    suffix: str  # its file under FACTORY_HOME/measurements is `<key><suffix>`


@dataclass(frozen=True)
class Flag:
    """The engine's option on `qf run`, `qf submit` and `qf watch add` (`--exl2 3.0,4.0`, `--awq`)."""

    help: str
    takes_value: bool  # `--exl2 3.0,4.0`; False: a switch (`--awq`)


@dataclass(frozen=True)
class Evaluation:
    """One score of a quant beyond its perplexity, on the same windows: recorded as the evaluation subject
    `<tag>:<suffix>` and in the quant's eval as `eval[group][key]` (EXL2: `kv_cache.q4`, subject `...:kv-q4`)."""

    group: str
    key: str
    load: Callable[[Path, str], Logits]
    unit: str = "window"

    @property
    def suffix(self) -> str:
        return f"{self.group.split('_')[0]}-{self.key}"


def format_scores(scores: dict[str, float | None]) -> str:
    """{"fp16": 16.6, "q4": None} -> "fp16 16.6000, q4 not finite"."""
    return ", ".join(f"{k} {p:.4f}" if p is not None else f"{k} not finite" for k, p in scores.items())


@dataclass(frozen=True)
class MemoryPlan:
    """What an engine's memory model says about a card (`qf plan`): its numbers (for --json), and a table and
    lines for people."""

    data: dict
    title: str = ""
    columns: tuple[str, ...] = ()
    rows: list[tuple[str, ...]] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)

    @classmethod
    def by_bpw(cls, result: dict, title: str, label: str, per_gpu: bool = False) -> MemoryPlan:
        """A bits-per-weight engine's plan: a row per size (weights, cache, the rest, the peak) and the best size."""
        h = human
        rows = [
            (
                f"{r['bpw']:.1f}",
                h(r["weights"]),
                h(r["cache"]),
                h(r["total"] - r["weights"] - r["cache"]),
                h(r["total"]),
                "yes" if r["fits"] else "no",
            )
            for r in result["rows"]
        ]
        columns = ("BPW", "WEIGHTS", "CACHE", "OTHER", "PEAK" + (" PER GPU" if per_gpu else ""), "FITS")
        return cls(result, title, columns, rows, [f"highest {label} bpw that fits: {result['best_bpw']:.2f}"])


class Part:
    """A part of an engine, bound to it (`self.engine`): its Memory or its Card."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine


class Memory(Part):
    """Its memory model (`qf plan`, `--fit`, the card's "fits on" table) and what one of its measure or quantize
    units takes of a machine (factory/jobs/packing.py): `engine.memory`. The defaults: no memory model, and the
    estimates below."""

    sizes_to_budget: ClassVar[bool] = False  # `--fit 24GB`: then it has fit_budgets(...)
    # (fixed seconds, seconds per billion parameters) of one measure or quantize unit on an H200 (docs/measured.md);
    # on a CPU, core-seconds per billion parameters
    UNIT_SECONDS: ClassVar[dict[str, tuple[float, float]]] = {"quantize": (60.0, 100.0)}
    # the power of the billions the second term grows with: 1, or 0.5 for a conversion bound by its launches, whose
    # seconds follow the layers (across Llama shapes about the square root of the parameters: 16, 28, 32 layers at
    # 1.1B, 3B, 8B)
    GROWTH: ClassVar[float] = 1.0
    CPU_CORE_SECONDS_PER_B: ClassVar[float] = 1600.0  # AutoAWQ on 2 cores: SmolLM2-135M in 118 s (scripts/demo)

    # the runtimes that load its quants, the first the one its memory model is of (`qf plan --runtime`, the ranking)
    runtimes: ClassVar[tuple[str, ...]] = ()

    def need(self, shape: Shape, params: Params, spec: QuantSpec, ctx: int, cache: str) -> tuple[int, int] | None:
        """(its weights' bytes, what its runtime takes of a card) for `spec` at `ctx` tokens with a `cache` KV cache,
        by its memory model (factory/ranking.py compares that with a budget less HEADROOM); None: no memory model."""
        return None

    def sizes(self) -> list[QuantSpec]:
        """The sizes it can make, before a model resolves them: the ranking's rows for quants not made yet. The
        default: what its recipe key makes when the recipe gives it nothing (`awq: {}`), else none."""
        try:
            return list(self.engine.targets.model_validate({}).specs())
        except (ValueError, SpecError):
            return []

    def plan(
        self, shape: Shape, params: Params, budget: int, ctx: int | None, cache: str, gpus: int
    ) -> MemoryPlan | None:
        """What its runtime needs on a card of `budget` bytes (x `gpus`) for `ctx` tokens with a `cache` KV cache,
        if the engine has a memory model."""
        return None

    def fit_budgets(
        self, source: str, budgets: str, ctx: int | None, cache: str, written: dict, note: Callable[[str], None]
    ) -> dict:
        """`--fit 24GB,16GB`: the recipe key for the sizes that fit those budgets (engines with sizes_to_budget)."""
        raise NotImplementedError

    def fits(self, folder: Path) -> list[dict] | None:
        """The longest context each GPU size holds with this quant (the card's "fits on" table), if it knows."""
        return None

    def unit_gpu_bytes(self, kind: str, spec: QuantSpec, shape: Shape, params: Params) -> int:
        """Peak GPU memory torch allocates in a `measure` or `quantize` unit, before the catalog has recorded one of
        the same source. A layer-by-layer conversion holds the calibration rows' hidden states going in and out of
        a layer (fp16) and about three fp16 copies of the largest of one decoder layer and the head (weights,
        quantized weights, working space). Measured on an H200 (the random 1.1B Llama): EXL2 pass 2.0 GiB against
        2.0 predicted, EXL3 4.2 GiB against 4.3."""
        lengths = self.engine.calibration_lengths(spec)
        rows, length = max(lengths, key=lambda rl: rl[0] * rl[1], default=(128, 2048))
        states = 2 * rows * length * shape.hidden * 2
        largest = max(params.linear // max(shape.layers, 1), params.head)
        return int(states + 3 * largest * 2)

    def unit_seconds(self, kind: str, parameters: int, device: str, cores: int, spec=None) -> float:
        """First-principles seconds of a measure or quantize unit, before the catalog has seen one near this size
        (`spec`: the unit's, where its settings change the work)."""
        billions = parameters / 1e9
        if device != "cuda":
            return 10.0 + self.CPU_CORE_SECONDS_PER_B * billions / max(cores, 1)
        fixed, per_b = self.UNIT_SECONDS.get(kind, self.UNIT_SECONDS["quantize"])
        return fixed + per_b * billions**self.GROWTH

    def unit_cores(self, kind: str, device: str) -> int:
        """CPU cores a unit of this engine keeps busy: on a GPU its child feeds the card from about one; on the CPU
        torch takes its threads (every core unless OMP_NUM_THREADS says fewer)."""
        return 1 if device == "cuda" else cpu_threads()


class Card(Part):
    """What its model card and `qf show` say about its quants, and where they go on the Hub: `engine.card`. A
    subclass sets `library_name` and `hub_repo` and implements `how_to_load`."""

    library_name: ClassVar[str]  # the model card's library_name
    hub_repo: ClassVar[str]  # the default Hub repo template (FACTORY_HUB_<NAME>_REPO replaces it)
    plot_marker: ClassVar[str] = "o"
    scores_about: ClassVar[dict[str, str]] = {}  # evaluations' group -> what it measures, for people
    every_variant_on_main: ClassVar[bool] = False  # main holds main_files of every variant (GGUF), not the newest's

    def how_to_load(self, folder: str) -> str:
        """The card's snippet after `qf pull ... -o FOLDER`: markdown code blocks."""
        raise NotImplementedError

    def load_note(self, folder: Path) -> str | None:
        """What a user must know to load this quant beyond the snippet (the card prints it under it), if anything."""
        return None

    def sections(self, rows: list[QuantRow], hub_repo: str | None = None) -> tuple[str, str]:
        """Markdown sections the card adds about this engine's quants (`rows`): one before the prompt format and
        the load snippets, one after them (EXL2: which size to pick; where each fits). `hub_repo`: the Hub repo
        whose main card this is (GGUF: what `ollama run hf.co/REPO` names); None for a registry folder's card."""
        return "", ""

    def describe_scores(self, row: QuantRow) -> list[str]:
        """Lines `qf show` prints about a quant's scores beyond perplexity."""
        return [
            f"perplexity through {text}: {format_scores(row.eval[group])}"
            for group, text in self.scores_about.items()
            if row.eval.get(group)
        ]

    def branch(self, tag: str) -> str:
        """The quant's branch in the engine's Hub repo: `exl2-4.0bpw` -> `4.0bpw`."""
        return tag.removeprefix(f"{self.engine.name}-")

    def tag_of_branch(self, branch: str) -> str:
        return f"{self.engine.name}-{branch}"

    def main_files(self, newest: Path) -> list[str]:
        """Which files of the newest quant (of each, with every_variant_on_main) also go on the repo's main branch
        (beside the card and its plot)."""
        return []


class Engine:
    """The interface, with the defaults most engines keep, in three parts: what it converts and how (the class
    attributes and hooks here), its memory model (`Memory`) and its card and Hub layout (`Card`), each bound to it
    (`engine.memory`, `engine.card`). A subclass sets the class attributes, implements `version`, `quantize` and
    `load`, and names its `Card` (which implements `how_to_load`); the rest it overrides where its method differs."""

    name: ClassVar[str]  # the method: in tags, the catalog, recipes and `--<name>`
    label: ClassVar[str]  # as people write it: EXL2
    spec: ClassVar[type[QuantSpec]]
    targets: ClassVar[type[Targets]]
    flag: ClassVar[Flag | None] = None  # None: recipes only
    tag_pattern: ClassVar[str]  # a regex its tags match in full
    tag_example: ClassVar[str]
    architectures: ClassVar[frozenset[str]]  # config.json `architectures[0]` it converts
    requires_cuda: ClassVar[bool] = False
    # then it has measure(stage, source_dir, calibration_file, rows, length, work_dir, out, earlier, emit,
    # processes=1) and measurement_settings(spec, stage); `processes`: how many processes it may run at once (EXL2's
    # layer ranges)
    shared: ClassVar[tuple[Shared, ...]] = ()
    default_calibration: ClassVar[str] = "builtin:c4"
    outputs: ClassVar[tuple[str, ...]]  # globs of what it writes beyond files.COMPANIONS; nothing else is published
    evaluator: ClassVar[str]  # the runtime its perplexity is measured with
    Memory: ClassVar[type[Memory]] = Memory  # its parts (above), bound to it as engine.memory and engine.card
    Card: ClassVar[type[Card]] = Card

    def __init__(self) -> None:
        self.memory: Memory = self.Memory(self)
        self.card: Card = self.Card(self)

    # what it makes -------------------------------------------------------------------------------------------
    def version(self) -> str:
        raise NotImplementedError

    def targets_from_flag(self, value: str | bool, written: dict) -> dict:
        """The recipe key for this engine that `--<name> VALUE` asks for, keeping the recipe's other settings."""
        return written

    def refuse(self, info: ModelInfo) -> str | None:
        """Why this engine cannot convert the model (one sentence), or None."""
        arch = info.architecture
        if arch in self.architectures:
            return None
        if info.vision is not None:
            taken = sorted(a for a in self.architectures if not a.endswith("ForCausalLM"))
            return (
                f"{self.label} does not convert the vision-language {arch}; it converts "
                f"{', '.join(taken) if taken else 'text models only'}"
            )
        return f"{self.label} does not convert {arch}; it converts {', '.join(sorted(self.architectures))}"

    def resolve(self, spec: QuantSpec, info: ModelInfo, device: str) -> QuantSpec:
        """Fill in defaults that depend on the model or the device, or refuse (SpecError) what cannot work."""
        return spec

    def fit_calibration(self, spec: QuantSpec, tokens: int, device: str) -> QuantSpec:
        """The spec once the calibration text is tokenized (`tokens` long), for defaults that depend on it."""
        return spec

    def calibration_windows(self, spec: QuantSpec) -> tuple[int, int] | None:
        """(rows, length) of the token windows `quantize` takes (request.calibration); None: it reads the text
        file (request.calibration_file) itself."""
        return None

    def calibration_lengths(self, spec: QuantSpec) -> list[tuple[int, int]]:
        """(rows, length) pairs the calibration text must hold enough tokens for."""
        windows = self.calibration_windows(spec)
        return [windows] if windows else []

    def describe_calibration(self, spec: QuantSpec, text: str) -> str:
        """The card's calibration column: the text set and how much of it was used."""
        return text

    def shared_units(self, spec: QuantSpec) -> tuple[Shared, ...]:
        """The shared units `spec` needs, in `shared`'s order: all of them, unless the model needs fewer (GGUF's
        vision projector, for a model with a vision tower only)."""
        return self.shared

    def measurement_settings(self, spec: QuantSpec, stage: str) -> tuple[int, int]:
        """(rows, length) of the calibration text its shared unit `stage` reads; (0, 0): it reads none, and its key
        leaves the calibration out (GGUF's 16-bit conversion serves every calibration)."""
        return 0, 0

    def made_from(self, spec: QuantSpec) -> list[QuantSpec]:
        """The job's other quants `spec` is made from, in the order its tool takes them (EXL3's optimized size: the
        uniform sizes around it, lowest first): its targets make them too, its shared units and its quantize unit
        wait for them and read their folders (`earlier`, `request.quants`), and its shared units' keys hold their
        weights keys."""
        return []

    def rival(self, spec: QuantSpec) -> QuantSpec | None:
        """The job's quant `spec` is kept only where it beats: a lower KL divergence from FP16 in no more tensor
        bytes (the gate drops it otherwise, and its publish step is skipped with both numbers); such a quant is off
        its format's size curve in the ranking. EXL3's optimized size: the uniform size of its bpw."""
        return None

    def measure(
        self,
        stage: str,
        source_dir: Path,
        calibration_file: Path,
        rows: int,
        length: int,
        work_dir: Path,
        out: Path,
        earlier: dict[str, Path],
        emit: Emit,
    ) -> None:
        """Make the shared unit `stage` into `out` (`earlier`: the files of the stages listed before it, by stage, then
        the folders of the quants its spec is made from, by tag: made_from)."""
        raise NotImplementedError

    def quantize(self, request: QuantizeRequest, emit: Emit) -> None:
        raise NotImplementedError

    # how it is scored ----------------------------------------------------------------------------------------
    def load(self, folder: Path, device: str) -> Logits:
        """A function from token ids to logits through the engine's own runtime, for perplexity and the KL
        divergence from FP16 (both computed from these logits); or a `factory.evaluation.layered.ByLayer` over the
        quant's weights, unpacked a layer at a time (see awq/evaluate.py), where the quant loads as an unquantized
        model."""
        raise NotImplementedError

    def evaluations(self, spec: QuantSpec) -> list[Evaluation]:
        """Scores beyond perplexity (EXL2: through quantized KV caches)."""
        return []


def check_quant_folder(out_dir: Path, weights: str, want: dict, tool: str, log: Path | None = None) -> None:
    """Outputs are checked, not trusted: weight files matching `weights`, and a config.json whose
    quantization_config says what the spec asked for (`want`)."""
    see = f"; see {log}" if log else ""
    if not list(out_dir.glob(weights)):
        raise JobFailed(f"{tool} wrote no {weights} into {out_dir}{see}")
    try:
        qc = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    except (OSError, ValueError, KeyError):
        raise JobFailed(f"{tool} wrote no quantization_config into {out_dir / 'config.json'}{see}") from None
    got = {k: qc.get(k) for k in want}
    if got != want:
        raise JobFailed(f"{tool}'s quantization_config {got} does not match the spec {want}")
