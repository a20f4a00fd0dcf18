"""What a submission asks for, from the options `qf run`, `qf submit` and the service take: a pipeline Request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from factory import engines
from factory.checkpoints.sources import check_base_model
from factory.errors import SpecError
from factory.recipes import build_recipe, recipe_from_yaml
from factory.specs import asks_fit


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
):
    """The Request for SOURCE: the recipe (a file, or its YAML text from a service's client) with the engine flags
    (`--<engine> 3.0,4.0`) and options applied; `fit` (VRAM budgets) becomes the sizing engine's sizes, each
    choice told to `say`."""
    from factory.jobs.planning import Request

    if base_model is not None:
        check_base_model(base_model)
    flags = dict(flags)
    written_recipe = recipe_from_yaml(recipe_text, "the recipe sent") if recipe_text is not None else None
    if fit:
        for engine in sizers(flags):
            if flags.get(engine.name) and not asks_fit(flags[engine.name]):
                raise SpecError(f"give --{engine.name} sizes or --fit budgets, not both")
            written = build_recipe(recipe, written=written_recipe).to_dict().get(engine.name, {})
            flags[engine.name] = engine.memory.fit_budgets(source, fit, ctx, kv_cache, written, say)
    chosen = build_recipe(
        recipe, flags, written=written_recipe, calibration=calibration, eval=eval_set, eval_windows=eval_windows
    )
    asked = {name for name, value in flags.items() if value}
    return Request(source=source, recipe=chosen, asked=asked, name=name, base_model=base_model, device=device)
