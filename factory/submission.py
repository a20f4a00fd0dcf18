"""What a submission asks for: its options (`Options`), as `qf run`, `qf submit` and the service take them, and the
pipeline Request they make (`Options.request`: their checks and defaults, in this one place).

`qf submit --server` sends the options as they are (`model_dump`: the recipe as its YAML text, read where the
command runs); the service reads the same model back (service/app.py's SubmitBody adds only its size limits).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from factory import engines, ranking
from factory.checkpoints.sources import check_base_model
from factory.errors import SpecError
from factory.evaluation import evaluate
from factory.recipes import build_recipe, recipe_from_yaml, recipe_text
from factory.specs import asks_fit

if TYPE_CHECKING:
    from factory.catalog import Catalog

SENT = "the recipe sent"  # what a recipe's sentences call it when it came as text


def sizers(flags: dict | None = None) -> list[engines.Engine]:
    """The engines `--fit` sizes: those whose flag is `fit` (`--gguf fit`), else the first that sizes quants to a
    budget (EXL2)."""
    able = [e for e in engines.all_engines() if e.memory.sizes_to_budget]
    asked = [e for e in able if asks_fit((flags or {}).get(e.name))]
    return asked or able[:1]


class Options(BaseModel):
    """A submission's options: SOURCE, the engine flags (`--<engine> 3.0,4.0`, engine name -> value), the recipe's
    YAML text (None: the standard recipe), the texts and windows, --name, --base-model, and --fit's VRAM budgets
    with --ctx and --kv-cache."""

    model_config = ConfigDict(extra="forbid")
    source: str
    flags: dict[str, str | bool | None] = {}
    recipe: str | None = None
    calibration: str | None = None
    eval: str | None = None
    eval_windows: int | None = Field(default=None, ge=1)
    name: str | None = None
    base_model: str | None = None
    fit: str | None = None
    ctx: int | None = Field(default=None, ge=1)
    kv_cache: str = "fp16"
    _recipe_where: str = PrivateAttr(default=SENT)  # how the recipe's sentences name it: its file, where it has one

    @classmethod
    def from_command_line(cls, recipe: Path | None = None, **options: object) -> Options:
        """The options of a `qf` command, whose --recipe names a file (read here, where the command runs)."""
        if options.get("base_model") is not None:
            check_base_model(str(options["base_model"]))  # before a `qf submit --server` sends anything
        made = cls(recipe=recipe_text(recipe) if recipe is not None else None, **options)
        if recipe is not None:
            made._recipe_where = f"recipe {str(recipe)!r}"
        return made

    def request(
        self,
        device: str | None = None,
        say: Callable[[str], None] = lambda line: None,
        catalog: Callable[[], Catalog] | None = None,
    ):
        """The Request these options make: the recipe with the engine flags and options applied; --fit's budgets
        (else the recipe's) become, for each budget, the largest size that fits of the engines asked with
        `--<engine> fit`, else what the ranking of the model's scored quants in `catalog` (opened only then) puts
        first, or, where none is scored yet, the sizing engine's (EXL2's) largest size that fits; each choice told to
        `say`. `device`: where the job will run (None: this machine)."""
        from factory.jobs.planning import Request

        if self.base_model is not None:
            check_base_model(self.base_model)
        flags = dict(self.flags)
        written = recipe_from_yaml(self.recipe, self._recipe_where) if self.recipe is not None else None
        fit = self.fit or build_recipe(written=written).fit
        if fit:
            asked_fit = [e for e in engines.all_engines() if asks_fit(flags.get(e.name))]
            if not asked_fit:  # `--fit` alone: across formats, by the ranking of the model's scored quants
                if flagged := [n for n, value in flags.items() if value]:
                    raise SpecError(f"give --{flagged[0]} sizes or --fit budgets, not both")
                model, fp16, quants = ranking.of_catalog(catalog() if catalog else None, self.source)
                if any(q.kld is not None for q in quants):
                    flags = _fit_flags(model, ranking.Model.of(fp16), quants, fit, self.ctx, self.kv_cache, device, say)
            if asked_fit or not any(flags.values()):  # `--gguf fit`, or nothing scored yet: the largest that fits
                for engine in sizers(flags):
                    targets = build_recipe(written=written).to_dict().get(engine.name, {})
                    flags[engine.name] = engine.memory.fit_budgets(
                        self.source, fit, self.ctx, self.kv_cache, targets, say
                    )
        chosen = build_recipe(
            None,
            flags,
            written=written,
            calibration=self.calibration,
            eval=self.eval,
            eval_windows=self.eval_windows,
        )
        asked = {name for name, value in flags.items() if value}
        return Request(
            source=self.source, recipe=chosen, asked=asked, name=self.name, base_model=self.base_model, device=device
        )


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
        flags[method] = ",".join(str(s.flag_value) for s in specs) if engine.flag.takes_value else True
    return flags
