"""What happens to a job before it runs: `submit` checks the request (exit 2/4/5 before any job exists) and
creates the job or finds the same one; `estimate` says how long a job just submitted should take.

The same job asked for again after `qf rm` removed a quant it published (`remake_removed`): the succeeded job goes
back to queued with that quant's steps superseded, and says so in one line; running it makes the quant again (under
the same rev if the files are the same, else a new one: factory/publish/publishing.py).

Plain functions of the catalog, the settings and where events go: nothing here runs under a lease.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import calibration
from factory import engines, events
from factory.catalog import Catalog, Job, JobState
from factory.checkpoints import sources
from factory.checkpoints.inspection import inspected
from factory.engines import QuantSpec
from factory.errors import FactoryError, SpecError
from factory.evaluation import evaluate, layered
from factory.events import Emit
from factory.identity import job_key
from factory.jobs import graph
from factory.jobs.conversions import measurement_keys
from factory.jobs.costs import AUTOMATIC_MAX_UNITS, Costs, Projection, Sized
from factory.jobs.packing import Packer
from factory.recipes import Recipe
from factory.registry import naming
from factory.settings import Settings
from factory.vram import HEADROOM, Params, Shape


@dataclass
class Request:
    """What a user asks for: a source and a recipe (`qf run`, `qf submit`, the service, the watchlist)."""

    source: str
    recipe: Recipe
    asked: set[str] = field(default_factory=set)  # engines a flag asked for: no CUDA is an error, not a skip
    name: str | None = None
    base_model: str | None = None  # what the model card names as base_model (default: the source's name)
    device: str | None = None  # where the job will run: None = this machine (qf run); qf submit: the workers'


def submit(catalog: Catalog, settings: Settings, emit: Emit, request: Request) -> tuple[Job, bool]:
    """(the job, whether it needs running: created now, or a succeeded one queued again by remake_removed)."""
    recipe = request.recipe
    device = request.device or evaluate.device()
    specs = _runnable(emit, recipe.specs(), request, device)
    used = [engines.get(name) for name in sorted({s.method for s in specs})]
    versions = {engine.name: engine.version() for engine in used}
    cal, ev = _calibration(recipe.calibration, used), calibration.resolve(recipe.eval)
    if cal.sha256 == ev.sha256:
        raise SpecError(f"calibration {cal.name!r} and eval {ev.name!r} are the same text; evaluate on held-out text")
    windows = recipe.eval_windows or evaluate.default_windows(device)

    source = sources.resolve(request.source, settings.cache)
    if source.path is not None:  # a folder that cannot work is refused before a job exists (a Hub repo: at fetch)
        info = inspected(source.path, engines.architectures(), source.identity, settings.cache)  # kept for the job
        for spec in specs:
            engines.resolve(spec, info, device)
    if request.name:
        ref = naming.parse(request.name)
        if ref.tag or ref.rev:
            raise SpecError(
                f"--name {request.name!r} holds a tag or revision; use --name NAME; tags come from "
                "the spec and revisions from the source"
            )
        name = catalog.jobs.name_for(source.source, ref.name, None)
    else:
        name = catalog.jobs.name_for(
            source.source, naming.model_name(source.label), naming.model_name(f"{source.owner}-{source.label}")
        )
    job, created = catalog.jobs.create(
        key=job_key(source.identity, [s.model_dump() for s in specs], cal.sha256, ev.sha256, windows, versions, device),
        name=name,
        source=source.source,
        source_identity=source.identity,
        base_model=request.base_model or source.base_model,
        specs=specs,
        calibration=cal.name,
        calibration_sha=cal.sha256,
        eval=ev.name,
        eval_sha=ev.sha256,
        eval_windows=windows,
        max_ppl_ratio=recipe.max_ppl_ratio,
        max_kld=recipe.max_kld,
        versions=versions,
        device=device,
    )
    emit(events.job(job.id, created, job.state, name, source.source, source.identity))
    if not created and remake_removed(catalog, emit, job):
        return catalog.jobs.get(job.id), True
    return job, created


def remake_removed(catalog: Catalog, emit: Emit, job: Job) -> bool:
    """A succeeded job whose quants were removed with `qf rm` (and not published again by another job) goes
    back to queued to make them again, their steps superseded; True when it did (and said so)."""
    if job.state != JobState.succeeded:
        return False
    removed = catalog.quants.removed(job.id)
    if not removed or not catalog.quants.reopen(job.id, sorted({q.tag for q in removed})):
        return False
    for q in removed:
        emit(events.note(f"job {job.id}: its quant {q.name}:{q.tag}@{q.rev} was removed with qf rm; making it again"))
    return True


def _runnable(emit: Emit, specs: list[QuantSpec], request: Request, device: str) -> list[QuantSpec]:
    """The specs this device can make: without CUDA, those of engines that need it are skipped with a note,
    or refused when a flag asked for them."""
    if device != "cuda":
        for engine in sorted(
            {engines.get(s.method) for s in specs if engines.get(s.method).requires_cuda}, key=lambda e: e.name
        ):
            if engine.name in request.asked:
                where = "this machine has" if request.device is None else "the workers (FACTORY_WORKER_DEVICE) have"
                flags = f"--{engine.name}" + (", --fit" if engine.memory.sizes_to_budget else "")
                others = [e for e in engines.all_engines() if not e.requires_cuda and e.flag]
                alternative = ", ".join(f"{e.label} runs without one (--{e.name})" for e in others)
                raise SpecError(
                    f"{engine.label} ({flags}) needs a CUDA GPU and {where} none"
                    + (f"; {alternative}" if alternative else "")
                )
            specs = [s for s in specs if s.method != engine.name]
            emit(events.note(f"no CUDA GPU: skipping the recipe's {engine.label} targets"))
    if not specs:
        flags = ", ".join(
            f"--{e.name}" + (" VALUE" if e.flag.takes_value else "") for e in engines.all_engines() if e.flag
        )
        raise SpecError(f"nothing to make: pass {flags}, or a recipe with {' or '.join(engines.available())} targets")
    return specs


def estimate(costs: Costs, settings: Settings, job: Job) -> tuple[float, float] | None:
    """(packed, one after another) expected seconds of a job that was just submitted, from its source's shape
    (config and headers only); None where the shape cannot be read here (a Hub repo without the network)."""
    try:
        config, tensors = sources.layout(job.source)
        specs = job.specs
        if Path(job.source).is_dir():  # the specs' defaults that depend on the model (a group size)
            info = inspected(Path(job.source), engines.architectures(), job.source_identity, settings.cache)
            specs = [engines.resolve(s, info, job.device) for s in specs]
        [s.tag for s in specs]  # noqa: B018  - a Hub repo's spec may have no tag before it is fetched
    except (FactoryError, ValueError):
        return None
    shape = Shape.of(config)
    model = Sized(shape, Params.of(tensors, shape), min(evaluate.WINDOW, shape.max_positions), layered.walkable(config))
    keys = {s.tag: measurement_keys(job, s) for s in specs}
    return costs.estimate(job, model, graph.units(specs, keys, True, bool(settings.hub_owner)))


def projection(costs: Costs, source: str, recipe: Recipe, vram: int, info) -> tuple[list[QuantSpec], Projection | None]:
    """How long `recipe` takes for `source` on one CUDA card of `vram` bytes beside `costs.cores()`, packed as
    the factory packs (`qf plan`): the specs its engines take (those that refuse the model are left out: `qf plan`
    says why) and the projection. Reads the config and safetensors headers only; `info` is what the engines'
    `refuse` read of them."""
    config, tensors = sources.layout(source)
    shape = Shape.of(config)
    model = Sized(shape, Params.of(tensors, shape), min(evaluate.WINDOW, shape.max_positions), layered.walkable(config))
    specs = [
        engines.get(s.method).resolve(s, info, "cuda")
        for s in recipe.specs()
        if engines.get(s.method).refuse(info) is None
    ]
    if not specs:  # every engine of the recipe refuses the model (qf plan says why)
        return [], None
    cal = _calibration(recipe.calibration, [engines.get(name) for name in sorted({s.method for s in specs})])
    job = Job(
        source=source,
        source_identity=f"plan:{source}",  # no job of it exists: no recorded peaks, the engines' estimates
        specs=specs,
        calibration_sha=cal.sha256,
        eval_windows=recipe.eval_windows or evaluate.default_windows("cuda"),
        device="cuda",
        versions={},  # the keys of units made from other quants hash their weights keys (Engine.made_from)
    )
    keys = {s.tag: measurement_keys(job, s) for s in specs}
    units = graph.units(specs, keys, True, False)
    packer = Packer(costs.max_units or AUTOMATIC_MAX_UNITS, max(0, vram - HEADROOM), costs.cores())
    return specs, costs.projection(job, model, units, packer)


def _calibration(name: str | None, used: list) -> calibration.TextSet:
    """The recipe's text set, else the engines' default: the longest of their defaults, so each has enough."""
    if name:
        return calibration.resolve(name)
    return max((calibration.resolve(e.default_calibration) for e in used), key=lambda t: len(t.text))
