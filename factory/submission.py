"""What a submission asks for, from the options `qf run`, `qf submit` and the service take: a pipeline Request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from factory import engines, ranking
from factory.checkpoints.sources import check_base_model
from factory.errors import SpecError
from factory.evaluation import evaluate
from factory.recipes import build_recipe, recipe_from_yaml
from factory.specs import asks_fit

if TYPE_CHECKING:
    from factory.catalog import Catalog


def sizers(flags: dict | None = None) -> list[engines.Engine]:
    """The engines `--fit` sizes: those whose flag is `fit` (`--gguf fit`), else the first that sizes quants to a
    budget (EXL2)."""
    able = [e for e in engines.all_engines() if e.memory.sizes_to_budget]
    asked = [e for e in able if asks_fit((flags or {}).get(e.name))]
    return asked or able[:1]


def request(
    source: str,
    flags: dict,
    recipe: Path | None = None,
    calibration: str | None = None,
    eval_set: str | None = None,
    eval_windows: int | None = None,
    name: str | None = None,
    base_model: str | None = None,
    device: str | None = None,
    fit: str | None = None,
    ctx: int | None = None,
    kv_cache: str = "fp16",
    say: Callable[[str], None] = lambda line: None,
    recipe_text: str | None = None,
    catalog: Callable[[], Catalog] | None = None,
):
    """The Request for SOURCE: the recipe (a file, or its YAML text from a service's client) with the engine flags
    (`--<engine> 3.0,4.0`) and options applied; `fit` (memory budgets; else the recipe's) becomes, for each budget,
    the largest size that fits of the engines asked with `--<engine> fit`, else what the ranking of the model's
    scored quants in `catalog` (opened only then) puts first, or, where none is scored yet, the sizing engine's
    (EXL2's) largest size that fits; each choice told to `say`."""
    from factory.jobs.planning import Request

    if base_model is not None:
        check_base_model(base_model)
    flags = dict(flags)
    written_recipe = recipe_from_yaml(recipe_text, "the recipe sent") if recipe_text is not None else None
    fit = fit or build_recipe(recipe, written=written_recipe).fit
    if fit:
        asked_fit = [e for e in engines.all_engines() if asks_fit(flags.get(e.name))]
        if not asked_fit:  # `--fit` alone: across formats, by the ranking of the model's scored quants
            if flagged := [n for n, value in flags.items() if value]:
                raise SpecError(f"give --{flagged[0]} sizes or --fit budgets, not both")
            model, fp16, quants = ranking.of_catalog(catalog() if catalog else None, source)
            if any(q.kld is not None for q in quants):
                flags = _fit_flags(model, ranking.Model.of(fp16), quants, fit, ctx, kv_cache, device, say)
        if asked_fit or not any(flags.values()):  # `--gguf fit`, or nothing scored yet: the largest size that fits
            for engine in sizers(flags):
                written = build_recipe(recipe, written=written_recipe).to_dict().get(engine.name, {})
                flags[engine.name] = engine.memory.fit_budgets(source, fit, ctx, kv_cache, written, say)
    chosen = build_recipe(
        recipe, flags, written=written_recipe, calibration=calibration, eval=eval_set, eval_windows=eval_windows
    )
    asked = {name for name, value in flags.items() if value}
    return Request(source=source, recipe=chosen, asked=asked, name=name, base_model=base_model, device=device)


def _fit_flags(
    name: str, model: ranking.Model, quants: list, fit: str, ctx: int | None, cache: str, device: str | None, say
) -> dict:
    """The engine flags that make what the ranking (factory/ranking.py) says for each `--fit` budget, across every
    format with a flag that takes the model on the job's device."""
    cuda = (device or evaluate.device()) == "cuda"
    formats = [
        e.name
        for e in engines.all_engines()
        if e.flag and e.refuse(model.info) is None and (cuda or not e.requires_cuda)
    ]
    chosen = ranking.choose(name, model, quants, fit, ctx, cache, formats, say)
    if not chosen:
        raise SpecError(f"every budget's best quant of {name} is published: qf pull {name} --fit SIZE gets it")
    flags = {}
    for method, specs in chosen.items():
        engine = engines.get(method)
        made = [engine.spec_from_dict(s) for s in specs]
        flags[method] = ",".join(str(s.flag_value) for s in made) if engine.flag.takes_value else True
    return flags
