"""What a submission asks for: its options (`Options`), as `qf run`, `qf submit` and the service take them, and the
pipeline Request they make (`Options.request`: their checks and defaults, in this one place).

`qf submit --server` sends the options as they are (`model_dump`: the recipe as its YAML text, read where the
command runs); the service reads the same model back (service/app.py's SubmitBody adds only its size limits).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from factory import engines
from factory.checkpoints.sources import check_base_model
from factory.errors import SpecError
from factory.recipes import build_recipe, recipe_from_yaml, recipe_text

SENT = "the recipe sent"  # what a recipe's sentences call it when it came as text


def sizer() -> engines.Engine:
    """The engine `--fit` sizes: the one that sizes quants to a VRAM budget."""
    return next(e for e in engines.all_engines() if e.memory.sizes_to_budget)


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

    def request(self, device: str | None = None, say: Callable[[str], None] = lambda line: None):
        """The Request these options make: the recipe with the engine flags and options applied; --fit's budgets
        become the sizing engine's sizes, each choice told to `say`. `device`: where the job will run (None: this
        machine)."""
        from factory.jobs.planning import Request

        if self.base_model is not None:
            check_base_model(self.base_model)
        flags = dict(self.flags)
        written = recipe_from_yaml(self.recipe, self._recipe_where) if self.recipe is not None else None
        if self.fit:
            engine = sizer()
            if flags.get(engine.name):
                raise SpecError(f"give --{engine.name} sizes or --fit budgets, not both")
            targets = build_recipe(written=written).to_dict().get(engine.name, {})
            flags[engine.name] = engine.memory.fit_budgets(self.source, self.fit, self.ctx, self.kv_cache, targets, say)
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
