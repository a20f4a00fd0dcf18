"""Engines: an FP16 folder + a spec + calibration -> quant files in an output folder, and everything else about
their method (see base.py for the interface, README.md to add one).

Each engine runs its tool in a child process (a crash or OOM fails the step, not `qf`), reports progress
events, and keeps no books: no catalog, no publishing. They are registered here by name; `register` adds one
(a test's engine, say), and FACTORY_ENGINES=module:attr[,module:attr...] names engines to register in every
process (workers and their job processes too). Registering an engine also registers its tag grammar with
`factory.registry.naming` and its spec class with `factory.specs` (which the catalog reads stored specs with).
"""

from __future__ import annotations

import importlib
import os

from factory import specs
from factory.checkpoints.inspection import ModelInfo
from factory.engines.awq.engine import ENGINE as AWQ
from factory.engines.awq_ct.engine import ENGINE as AWQCT
from factory.engines.base import (
    Emit,
    Engine,
    Evaluation,
    Flag,
    Logits,
    QuantizeRequest,
    QuantSpec,
    Shared,
    check_quant_folder,
)
from factory.engines.exl2.engine import ENGINE as EXL2
from factory.engines.exl3.engine import ENGINE as EXL3
from factory.engines.gguf.engine import ENGINE as GGUF
from factory.errors import ModelRefused, SpecError
from factory.registry import naming

_ENGINES: dict[str, Engine] = {}
_PLUGIN_ERROR: list[SpecError] = []  # a FACTORY_ENGINES entry that cannot be loaded (check_plugins says so)


def register(engine: Engine) -> Engine:
    _ENGINES[engine.name] = engine
    naming.register_tag(engine.name, engine.tag_pattern, engine.tag_example)
    specs.register(engine.name, engine.spec)
    return engine


def unregister(name: str) -> None:
    _ENGINES.pop(name, None)
    naming.unregister_tag(name)
    specs.unregister(name)


def get(name: str) -> Engine:
    if name not in _ENGINES:
        raise SpecError(f"no engine named {name!r}; available: {', '.join(available())}")
    return _ENGINES[name]


def available() -> list[str]:
    return sorted(_ENGINES)


def all_engines() -> list[Engine]:
    return [_ENGINES[n] for n in available()]


def architectures() -> set[str]:
    """What inspection accepts: the architectures some engine converts; the engine of each spec of a job refuses
    the rest itself, with its own reason (resolve)."""
    return {a for engine in all_engines() for a in engine.architectures}


def resolve(spec: QuantSpec, info: ModelInfo, device: str) -> QuantSpec:
    """The spec with its model- and device-dependent defaults, after its engine said it can take the model."""
    engine = get(spec.method)
    if (reason := engine.refuse(info)) is not None:
        raise ModelRefused(reason)
    return engine.resolve(spec, info, device)


def of_tag(tag: str) -> Engine:
    """The engine whose tags look like `tag` (`exl2-4.0bpw` -> EXL2)."""
    for engine in all_engines():
        if naming.tag_matches(engine.name, tag):
            return engine
    raise SpecError(f"no engine makes tags like {tag!r}; tags look like {naming.tag_examples()}")


def _builtin() -> None:
    for engine in (AWQ, AWQCT, EXL2, EXL3, GGUF):
        register(engine)


def _plugins(names: str) -> None:
    """FACTORY_ENGINES: engines outside this package, each an Engine instance named `module:attribute`. One that
    cannot be loaded is kept for check_plugins (every command calls it: one sentence, exit 2), not raised at
    import."""
    for entry in filter(None, (n.strip() for n in names.split(","))):
        module, _, attribute = entry.partition(":")
        try:
            engine = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as e:
            _PLUGIN_ERROR.append(SpecError(f"FACTORY_ENGINES names {entry!r}, which cannot be loaded: {e}"))
            return
        if not isinstance(engine, Engine):
            _PLUGIN_ERROR.append(SpecError(f"FACTORY_ENGINES names {entry!r}, which is not an engine"))
            return
        register(engine)


def check_plugins() -> None:
    if _PLUGIN_ERROR:
        raise _PLUGIN_ERROR[0]


_builtin()
_plugins(os.environ.get("FACTORY_ENGINES", ""))

__all__ = [
    "Emit",
    "Engine",
    "Evaluation",
    "Flag",
    "Logits",
    "QuantSpec",
    "QuantizeRequest",
    "Shared",
    "all_engines",
    "available",
    "check_plugins",
    "check_quant_folder",
    "get",
    "of_tag",
    "register",
    "unregister",
]
