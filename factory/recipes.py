"""Recipes: what to make of one model, as YAML (configs/standard.yaml) or command-line flags.

A recipe has a key per engine (its name, e.g. `<engine>: {bpw: [...], head_bits: 6}`; each engine's `targets` class
validates its key) and the settings every engine shares: calibration, eval, eval_windows, max_ppl_ratio, max_kld,
fit (VRAM budgets: what `--fit` makes, factory/submission.py).
Unknown keys are refused with one sentence that lists the known ones (exit 2).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, field_validator

from factory import engines
from factory.engines.base import QuantSpec, Targets
from factory.errors import SpecError
from factory.specs import Closed

DEFAULT_EVAL = "builtin:wiki"
STANDARD = "standard.yaml"  # in the `configs` package (package data, so a wheel has it too)
# The most eval windows a recipe may ask for: 100000 x 2048 tokens is 205M tokens, about 800 MB of text scored for
# FP16 and every quant (hours on an H200 for a small model); far beyond the protocol's 48, and well inside the catalog's
# 32-bit integer column. The service's submission body bounds its field with the same constant.
MAX_EVAL_WINDOWS = 100_000


class Settings(Closed):
    calibration: str | None = None  # None: the longest of the engines' defaults
    eval: str = DEFAULT_EVAL
    eval_windows: int | None = None
    max_ppl_ratio: float = Field(1.5, gt=0)
    max_kld: float | None = Field(None, gt=0)  # None: no limit on the KL divergence from FP16
    fit: str | None = None  # VRAM budgets ("24GB,16GB"): what `--fit` makes (factory/submission.py)

    @field_validator("eval_windows")
    @classmethod
    def _windows(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_EVAL_WINDOWS:
            raise ValueError(
                f"must be between 1 and {MAX_EVAL_WINDOWS} (2048-token windows of the eval text), not {value}"
            )
        return value


@dataclass(frozen=True)
class Recipe:
    targets: dict[str, Targets] = field(default_factory=dict)  # engine name -> what to make with it
    settings: Settings = field(default_factory=Settings)

    def __getattr__(self, name: str):  # recipe.eval, recipe.calibration, ...
        if name in Settings.model_fields:
            return getattr(self.settings, name)
        raise AttributeError(name)

    def specs(self) -> list[QuantSpec]:
        return [s for name in sorted(self.targets) for s in self.targets[name].specs()]

    def to_dict(self) -> dict:
        """The recipe as YAML would hold it (None values left out)."""
        return {
            **{n: t.model_dump(exclude_none=True) for n, t in self.targets.items()},
            **self.settings.model_dump(exclude_none=True),
        }


def _keys() -> str:
    return ", ".join([*engines.available(), *Settings.model_fields])


def _problems(key: str | None, err: ValidationError) -> list[str]:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in ([key] if key else []) + list(e["loc"])) or "recipe"
        if e["type"] == "extra_forbidden":
            parts.append(f"unknown key {loc!r}")
        else:
            parts.append(f"{loc}: {e['msg'].removeprefix('Value error, ')}")
    return parts


def recipe_from_dict(data: object, where: str) -> Recipe:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{where}: a recipe is a YAML mapping with keys {_keys()}")
    problems = [f"unknown key {k!r}" for k in data if k not in Settings.model_fields and k not in engines.available()]
    targets = {}
    for name in (k for k in data if k in engines.available() and data[k] is not None):
        try:
            targets[name] = engines.get(name).targets.model_validate(data[name])
        except SpecError as e:
            problems.append(f"{name}: {e.message}")
        except ValidationError as e:
            problems += _problems(name, e)
    try:
        settings = Settings.model_validate({k: v for k, v in data.items() if k in Settings.model_fields})
    except ValidationError as e:
        problems += _problems(None, e)
    if problems:
        raise SpecError(f"{where}: " + "; ".join(problems) + f" (recipe keys: {_keys()})")
    return Recipe(targets=targets, settings=settings)


def recipe_text(path: Path) -> str:
    """The text of the recipe file `path` (one that is not there: SpecError)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"recipe {str(path)!r} does not exist; pass a YAML file such as configs/standard.yaml")
    return path.read_text(encoding="utf-8")


def load_recipe(path: Path) -> Recipe:
    return recipe_from_yaml(recipe_text(path), f"recipe {str(path)!r}")


def recipe_from_yaml(text: str, where: str) -> Recipe:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise SpecError(f"{where} is not valid YAML{at}") from None
    return recipe_from_dict(data, where)


@functools.cache  # package data; build_recipe copies it (to_dict) before changing anything
def standard_recipe() -> Recipe:
    return recipe_from_yaml(
        resources.files("configs").joinpath(STANDARD).read_text(encoding="utf-8"),
        f"the standard recipe (configs/{STANDARD})",
    )


def build_recipe(
    path: Path | None = None,
    flags: dict[str, str | bool | None] | None = None,
    written: Recipe | None = None,
    **overrides: object,
) -> Recipe:
    """The recipe a command line asks for: --recipe FILE (or `written`, one already read), else the standard
    recipe. Engine flags (`flags`, or
    keyword arguments named after an engine: `<engine>="4.0,5.0"`, `<engine>=True`) replace its targets, keeping its
    settings for those engines; other options that are not None replace its keys."""
    flags = {**(flags or {}), **{k: overrides.pop(k) for k in list(overrides) if k in engines.available()}}
    asked = {name: value for name, value in flags.items() if value not in (None, False)}
    if written is None:
        written = load_recipe(path) if path else standard_recipe()
    data = written.to_dict()
    if asked:  # the flags say what to make: the recipe's other targets are dropped
        written = {name: data.pop(name) for name in engines.available() if name in data}
        for name, value in asked.items():
            data[name] = engines.get(name).targets_from_flag(value, written.get(name, {}))
    data.update({k: v for k, v in overrides.items() if v is not None})
    return recipe_from_dict(data, "options")
