"""Which quant to pull: every quant of a model, of every format, on one axis. Each quant the factory published was
scored on the same token windows against the same FP16 reference, so their KL divergences from FP16 compare across
formats. `rank` is the one ranking: the quants whose runtime fits a budget at a context (each engine's memory model,
`Engine.memory.need`), lowest KLD first. `qf plan`, `qf pull --fit`, `--fit` in a job and the card's table of picks
all read it.

Rows of the ranking:
  measured   a published quant, with its scores on the ranking's windows
  expected   a size its engine can make that is not made yet, between two measured sizes of the same format on this
             model: its KLD read off that format's measured curve (log KLD linear in bits between the two neighbours)
  unscored   a size no measured curve covers (outside the measured range, or a format with fewer than two measured
             sizes): never ranked above a scored row, listed so that a job can still choose by size
Quants scored on other windows or text than most of the model's are left out (their KLD is not comparable) and said.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from calibration import public_name
from factory import engines, vram
from factory.checkpoints import sources
from factory.errors import SpecError
from factory.specs import QuantSpec

if TYPE_CHECKING:
    from factory.catalog import Catalog
    from factory.checkpoints.inspection import ModelInfo
    from factory.registry.published import QuantRow

NO_CURVE = "no measured curve on this model"  # a format's curve: two of its sizes scored on the same windows
BUDGETS = (8, 12, 16, 24, 48, 80)  # GiB: the card's picks
CONTEXTS = (8192, 32768)


@dataclass(frozen=True)
class Model:
    """What a ranking reads of the FP16 checkpoint: its shape, parameter counts and what the engines refuse by."""

    shape: vram.Shape
    params: vram.Params
    info: ModelInfo

    @classmethod
    def of(cls, source: str) -> Model:
        return cls(*vram.source_model(source))


@dataclass(frozen=True)
class Ranked:
    tag: str
    method: str
    bits: float
    bytes: int  # the published files; for a quant not made yet its weights by the memory model
    need: int | None  # what its runtime takes of the card at the context (None: its engine has no memory model)
    fits: bool
    runtime: str
    kind: str  # measured | expected | unscored
    basis: str  # where its numbers come from, for people
    spec: QuantSpec
    kld: float | None = None
    top1: float | None = None
    ppl: float | None = None
    rev: str | None = None  # a published quant's

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"spec": self.spec.model_dump()}


@dataclass(frozen=True)
class Ranking:
    name: str
    budget: int
    ctx: int
    cache: str
    runtime: str | None
    protocol: str  # the windows every KLD here was measured on
    rows: list[Ranked]  # those that fit (scored ones by KLD, then unscored ones), then those that do not, alike
    notes: list[str] = field(default_factory=list)

    @property
    def room(self) -> int:
        return self.budget - vram.HEADROOM

    @property
    def ranked(self) -> list[Ranked]:
        """Scored rows that fit, lowest KLD first."""
        return [r for r in self.rows if r.fits and r.kld is not None]

    @property
    def published(self) -> list[Ranked]:
        return [r for r in self.ranked if r.kind == "measured"]

    def where(self) -> str:
        runtime = f" with {self.runtime}" if self.runtime else ""
        return f"{vram.human(self.budget)} at {self.ctx} tokens ({self.cache} cache){runtime}"

    def to_json(self) -> dict:
        return {
            "model": self.name,
            "budget": self.budget,
            "headroom": vram.HEADROOM,
            "ctx": self.ctx,
            "cache": self.cache,
            "runtime": self.runtime,
            "protocol": self.protocol,
            "rows": [r.to_json() for r in self.rows],
            "notes": self.notes,
        }


def of_catalog(catalog: Catalog | None, arg: str) -> tuple[str, str, list[QuantRow]]:
    """The model `arg` names, a name in the catalog or the folder or Hub repo its quants were made from: its name, the
    FP16 source to size it from (the newest quant's, for a name) and its published quants, each with every
    evaluation of its files. A source the catalog has no quant of: its folder's name, itself, none."""
    path = sources.local(arg)  # `~user` of nobody: NotFound, exit 4
    origins = {arg, str(path.resolve())} if path.is_dir() else {arg}
    quants = catalog.quants.live() if catalog is not None else []
    mine = [q for q in quants if q.name == arg.lower()]
    mine = mine or [q for q in quants if q.source in origins or q.source.split("@")[0] == arg]
    if not mine:
        return (path.name if path.is_dir() else arg).lower(), arg, []
    name = mine[0].name
    mine = sorted((q for q in quants if q.name == name), key=lambda q: q.created_at)
    fp16 = arg if path.is_dir() else mine[-1].source
    return name, fp16, [catalog.quants.row(q) for q in mine]


def runtimes() -> list[str]:
    return sorted({r for e in engines.all_engines() for r in e.memory.runtimes})


def check_runtime(runtime: str | None) -> str | None:
    """Rules: one of the engines' runtimes, any case. Valid: "llama.cpp", "vLLM". Not valid: "safetensors" (a file
    format)."""
    if runtime is None:
        return None
    known = runtimes()
    if runtime.lower() not in known:
        raise SpecError(f"runtime {runtime!r} is not one the factory sizes for: {', '.join(known)}")
    return runtime.lower()


def rank(
    name: str,
    model: Model,
    quants: list[QuantRow],
    budget: int,
    ctx: int | None = None,
    cache: str = "fp16",
    runtime: str | None = None,
    expected: bool = True,
    formats: list[str] | None = None,
) -> Ranking:
    """The ranking of model `name`'s published `quants` (and, with `expected`, the sizes not made yet that its
    engines, or only `formats`, could make) for a card of `budget` bytes at `ctx` tokens (the model's maximum by
    default) with a `cache` KV cache, loaded by `runtime` (any by default)."""
    runtime = check_runtime(runtime)
    ctx = ctx or model.shape.max_positions
    if ctx > model.shape.max_positions:
        raise SpecError(f"a context of {ctx} tokens is more than the model's {model.shape.max_positions} positions")
    protocol, scored, notes = _on_one_protocol(quants)
    room = budget - vram.HEADROOM
    allowed = [e for e in engines.all_engines() if formats is None or e.name in formats]
    rows: list[Ranked] = []

    def sized(engine, spec, **scores) -> Ranked | None:
        if runtime is not None and runtime not in engine.memory.runtimes:
            return None
        try:
            need = engine.memory.need(model.shape, model.params, spec, ctx, cache)
        except (SpecError, KeyError, ValueError):  # a KV cache type this runtime does not have (`fp8` for EXL2)
            need = None
        weights, total = need if need is not None else (0, None)
        scores.setdefault("bytes", weights)
        first = engine.memory.runtimes[0] if engine.memory.runtimes else engine.evaluator
        return Ranked(
            spec=spec,
            tag=spec.tag,
            method=engine.name,
            bits=spec.bits,
            need=total,
            fits=total is not None and total <= room,
            runtime=runtime or first,
            **scores,
        )

    for row, kld, top1, ppl in scored:
        engine = engines.get(row.method)
        if engine not in allowed:
            continue
        made = sized(
            engine,
            row.spec,
            bytes=row.bytes,
            kind="measured",
            basis=f"measured (job {row.job})",
            kld=kld,
            top1=top1,
            ppl=ppl,
            rev=row.rev,
        )
        rows += [made] if made else []
    if expected:
        for engine in allowed:
            if engine.refuse(model.info) is not None:
                continue
            rows += _not_made(engine, model, scored, {q.tag for q in quants}, sized)
    rows.sort(key=lambda r: (not r.fits, r.kld is None, r.kld if r.kld is not None else 0.0, -r.bits))
    return Ranking(name, budget, ctx, cache, runtime, protocol, rows, notes)


def _not_made(engine, model: Model, scored: list, made: set[str], sized) -> list[Ranked]:
    """The sizes `engine` could make of the model that are not published (`made`): expected from its measured curve
    where one covers them, else unscored. A quant made to beat another (Engine.rival: EXL3's optimized size) is off
    the curve: it is ranked as measured, and no size is read off it."""
    scored = [s for s in scored if s[0].method == engine.name and engine.rival(s[0].spec) is None]
    curve = sorted({row.bits: kld for row, kld, *_ in scored if kld and kld > 0}.items())
    rows = []
    for spec in engine.memory.sizes():
        try:
            spec = engine.resolve(spec, model.info, "cuda" if engine.requires_cuda else "cpu")
        except SpecError:
            continue
        if spec.tag in made:
            continue
        between = [(a, b) for a, b in zip(curve, curve[1:], strict=False) if a[0] < spec.bits < b[0]]
        if between:
            (x0, y0), (x1, y1) = between[0]
            kld = math.exp(math.log(y0) + (math.log(y1) - math.log(y0)) * (spec.bits - x0) / (x1 - x0))
            low, high = _tag_at(scored, engine.name, x0), _tag_at(scored, engine.name, x1)
            basis = f"expected: {engine.label}'s measured curve on this model, between {low} and {high}"
            row = sized(engine, spec, kind="expected", basis=basis, kld=kld)
        else:
            why = (
                f"outside {engine.label}'s measured range on this model ({curve[0][0]:g}-{curve[-1][0]:g} bits)"
                if len(curve) >= 2
                else NO_CURVE
            )
            row = sized(engine, spec, kind="unscored", basis=why)
        rows += [row] if row else []
    return rows


def _tag_at(scored: list, method: str, bits: float) -> str:
    return next(row.tag for row, *_ in scored if row.method == method and row.bits == bits)


def _on_one_protocol(quants: list[QuantRow]) -> tuple[str, list[tuple], list[str]]:
    """The newest quant of each tag with its scores on the windows most of them were scored on (its own evaluation
    or a later job's of the same files), and a note for those that have none there."""
    newest: dict[str, QuantRow] = {}
    for q in sorted(quants, key=lambda q: q.created_at):
        newest[q.tag] = q
    if not newest:
        return "", [], []

    def evaluations(q: QuantRow) -> list[dict]:
        own = {**q.eval, "ppl": q.ppl, "kld": q.kld, "top1": q.top1}
        return [own, *(q.evaluations or [])]

    def key(e: dict) -> tuple:
        return (public_name(e["text"]), e["windows"], e["window_length"])

    counts: dict[tuple, int] = {}
    for q in newest.values():
        for k in {key(e) for e in evaluations(q) if e.get("kld") is not None}:
            counts[k] = counts.get(k, 0) + 1
    if not counts:
        return "", [], [f"none of the {len(newest)} published quants has a KLD (published before it was measured)"]
    best = max(counts, key=lambda k: counts[k])
    scored, others = [], []
    for q in newest.values():
        e = next((e for e in evaluations(q) if key(e) == best and e.get("kld") is not None), None)
        if e is None:
            others.append(q.tag)
        else:
            scored.append((q, e["kld"], e["top1"], e["ppl"]))
    sample = next(e for q, *_ in scored for e in evaluations(q) if key(e) == best)
    protocol = f"{public_name(sample['text'])}, {sample['windows']} x {sample['window_length']} tokens"
    notes = [f"not ranked, scored on other windows than {protocol}: {', '.join(sorted(others))}"] if others else []
    return protocol, scored, notes


def frontier(rows: list) -> list:
    """The quants (QuantRow or Ranked) no smaller one beats: by size, each with a lower KLD than every smaller
    one's."""
    best, out = math.inf, []
    for r in sorted((r for r in rows if r.kld is not None), key=lambda r: r.bytes):
        if r.kld < best:
            best = r.kld
            out.append(r)
    return out


def picks(
    name: str, model: Model, quants: list[QuantRow], budgets=BUDGETS, contexts=CONTEXTS
) -> dict[tuple[int, int], Ranked | str]:
    """For each budget (GiB) and context: the published quant with the lowest KLD that fits, or why none."""
    out: dict[tuple[int, int], Ranked | str] = {}
    for ctx in contexts:
        for gib in budgets:
            if ctx > model.shape.max_positions:
                out[gib, ctx] = f"the model holds {model.shape.max_positions} tokens"
                continue
            ranking = rank(name, model, quants, gib * vram.GiB, ctx, expected=False)
            out[gib, ctx] = ranking.published[0] if ranking.published else "none fits"
    return out


def choose(
    name: str,
    model: Model,
    quants: list[QuantRow],
    budgets: str,
    ctx: int | None,
    cache: str,
    formats: list[str],
    say,
) -> dict[str, list[QuantSpec]]:
    """`--fit 24GB,16GB` across `formats`: for each budget, what the ranking says to make, as specs by engine. The
    best scored row that fits: nothing to make when it is published (said), else that size (expected from its
    format's curve). Where no row that fits is scored yet (no curve of any format), the largest size of each format
    that fits, so that the job measures them. Each choice is told to `say`."""
    chosen: dict[str, list[QuantSpec]] = {}
    for text in (t.strip() for t in budgets.split(",")):
        ranking = rank(name, model, quants, vram.parse_size(text), ctx, cache, formats=formats)
        where = f"--fit {text}: {ranking.ctx} tokens ({cache} cache)"
        if ranking.ranked:
            best = ranking.ranked[0]
            if best.kind == "measured":
                say(f"{where}: {best.tag}@{best.rev} is published and has the lowest KLD that fits ({best.kld:.4f})")
                continue
            say(f"{where}: {best.tag}, KLD about {best.kld:.4f}, the lowest that fits ({best.basis})")
            picks = [best]
        else:
            largest: dict[str, Ranked] = {}
            for r in ranking.rows:
                if r.fits and r.kind == "unscored" and r.bits > getattr(largest.get(r.method), "bits", 0):
                    largest[r.method] = r
            if not largest:
                raise SpecError(f"nothing of {name} fits {vram.human(ranking.budget)} at {ranking.ctx} tokens")
            picks = sorted(largest.values(), key=lambda r: r.method)
            say(
                f"{where}: no format has a measured curve on {name} yet, so the largest size of each that fits: "
                + ", ".join(r.tag for r in picks)
            )
        for r in picks:
            if r.spec not in chosen.setdefault(r.method, []):
                chosen[r.method].append(r.spec)
    return chosen
