"""The layers of the code, checked on its import graph: a module imports only its own layer and the ones below (the
README's Layout draws them), the leaves import nothing above them, engines never import the catalog or publishing,
factory/ never imports workers/ (the queue is an entry point), every import inside a function has its reason, no
module outside factory/engines/ names a method, and no module imports one that imports it back (one cycle allowed,
with why). An engine that lives only in tests/ runs end to end in tests/integration/test_engine_extension.py."""

from __future__ import annotations

import ast

from factory import engines, fleet
from tests.support import ROOT

CYCLES_INSPECT = (
    "inspect refuses a source it cannot read with dequantize's reasons (FP8, MXFP4, GGUF, quantized formats), and "
    "dequantize reads configs and headers with inspect's bounded readers: one function-level import, in "
    "inspect.inspect"
)

# -- layers -------------------------------------------------------------------------------------------------------
# Direction of knowledge: a module imports only modules of its own layer or a lower one, at module level
# or inside a function alike. The leaves import nothing but errors (and a published row its spec's type, from the
# leaf specs); engines never see the catalog or publishing.
LAYERS = [
    ["factory.errors"],
    [
        "factory.settings",
        "factory.specs",
        "factory.events",
        "factory.tables",
        "factory.identity",
        "factory.hubclient",
        "factory.registry",
        "calibration",
    ],
    ["factory.checkpoints", "factory.catalog"],
    ["factory.evaluation", "factory.vram"],
    ["factory.engines"],
    ["factory.ranking"],
    ["factory.recipes", "factory.schedule", "factory.publish", "factory.jobs"],
    ["factory.factory", "factory.submission", "factory.fleet"],
    ["factory.cli", "factory.service", "workers"],
]
LEAVES = {
    "factory.errors",
    "factory.settings",
    "factory.specs",
    "factory.registry.naming",
    "factory.events",
    "factory.registry.published",
}


def _modules():
    for folder in ("factory", "workers", "calibration"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            yield name, path, ast.parse(path.read_text())


def _imports(tree) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def _layer(module: str) -> int:
    """The layer of the longest prefix that names `module` (factory.publish.upstream before factory.publish)."""
    best, layer = "", None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best):
                best, layer = name, i
    assert layer is not None, f"{module} is in no layer: add it to LAYERS"
    return layer


def test_lower_layers_never_import_higher_ones():
    problems = []
    for name, _, tree in _modules():
        imported = {m for m in _imports(tree) if m.split(".")[0] in ("factory", "workers", "calibration")}
        imported = {m for m in imported if m != "factory"}  # `from factory import x` names x itself, listed too
        if name in LEAVES:
            problems += [
                f"{name} imports {m}" for m in imported if not m.startswith(("factory.errors", "factory.specs"))
            ]
        here = _layer(name)
        problems += [
            f"{name} (layer {here}) imports {m} (layer {_layer(m)})" for m in sorted(imported) if _layer(m) > here
        ]
        if name.startswith("factory.engines"):  # engines keep no books and publish nothing
            problems += [
                f"{name} imports {m}"
                for m in sorted(imported)
                if m.split(".")[:2] in (["factory", "catalog"], ["factory", "publish"])
            ]
    assert problems == []


def _drawn_layers() -> list[set[str]]:
    """The README's Layout drawing as LAYERS, lowest first: a line's packages are the words before its description
    (two spaces apart), and a line that starts with two spaces goes on the one above it."""
    block = (ROOT / "README.md").read_text().split("## Layout", 1)[1].split("```", 2)[1]
    floors: list[set[str]] = []
    for line in block.strip("\n").splitlines():
        names = line.strip().split("  ")[0] if not line.startswith("   ") else ""
        words = {w.strip().rstrip("/") for w in names.split(",") if w.strip()}
        modules = {
            w.replace("/", ".") if "/" in w or w in ("workers", "calibration") else f"factory.{w}" for w in words
        }
        if line.startswith("  ") and floors:
            floors[-1] |= modules
        else:
            floors.append(modules)
    return floors[::-1]


def test_the_readmes_layout_is_the_layers():
    assert _drawn_layers() == [set(floor) for floor in LAYERS]


def test_factory_never_imports_workers():
    """workers/ (Celery on Redis) knows factory/, never the reverse: `qf` and the service reach the fleet through
    factory/fleet.py's Queue, which workers/celery_queue.py implements and pyproject.toml plugs in (an entry point)."""
    problems = [
        f"{name} imports {m}"
        for name, _, tree in _modules()
        if name.startswith("factory")
        for m in sorted(_imports(tree))
        if m == "workers" or m.startswith("workers.")
    ]
    assert problems == [], (
        "factory/ must not import workers/ (not even inside a function): ask factory.fleet.get() for what the fleet "
        f"does, and add it to factory/fleet.py's Queue and workers/celery_queue.py if it is new: {problems}"
    )


def test_the_queue_is_celery_through_the_entry_point():
    """What `qf submit` and the service load: the Celery queue (an installation whose metadata lacks the entry point,
    installed before it existed, needs `pip install -e .` again)."""
    from workers.celery_queue import QUEUE

    assert fleet.get() is QUEUE
    assert isinstance(QUEUE, fleet.Queue)


# Imports inside a function in factory/ and workers/, each with why it is not at the top of its module (issue 34):
# (module, what it imports: a module of ours, or a third-party package) -> the reason. Any other goes to module level.
_TORCH = (
    "torch and what imports it (transformers, safetensors' torch API, compressed-tensors): seconds of import on the "
    "paths that do not compute (`qf --help`, `qf status`, the worker's own process)"
)
_NUMPY = "numpy: import cost on the paths that do not compute; only tokenized windows and EXL3's calibration file"
_CUDA = "exllamav2, exllamav3, autoawq: importing loads (or builds, the first time) their CUDA extensions"
_LLMCOMPRESSOR = "llmcompressor: only in AWQ-CT's child process, in the engine's own environment (awq_ct/env.py)"
_HUB = "huggingface_hub (and its HTTP client httpx2): import cost (0.4 s) on paths that never reach the Hub"
_PLOT = "matplotlib: import cost (1.3 s), only to draw a card's plot"
_CATALOG = (
    "the catalog and what imports it (SQLAlchemy; the service's client also httpx): 0.3 s on the commands that do "
    "not open the catalog (`qf --help`, `qf plan`, `qf status` in plain SQL, `qf submit --server`)"
)
_DRIVERS = "`qf status` in plain SQL: only the database driver (psycopg2) or broker client (redis) it needs"
_SERVER = "uvicorn: import cost on every `qf` command, only `qf serve` needs it"
FUNCTION_IMPORTS = {
    **dict.fromkeys(
        [
            ("factory.checkpoints.dequantize", "torch"),
            ("factory.engines.child", "torch"),
            ("factory.engines.awq.evaluate", "safetensors"),
            ("factory.engines.awq.evaluate", "torch"),
            ("factory.engines.awq.evaluate", "transformers"),
            ("factory.engines.awq.quantize", "torch"),
            ("factory.engines.awq.quantize", "transformers"),
            ("factory.engines.awq_ct.evaluate", "compressed_tensors"),
            ("factory.engines.awq_ct.evaluate", "safetensors"),
            ("factory.engines.awq_ct.quantize", "torch"),
            ("factory.engines.awq_ct.quantize", "transformers"),
            ("factory.engines.exl2.evaluate", "torch"),
            ("factory.engines.exl2.ranges", "torch"),
            ("factory.engines.exl2.ranges", "safetensors"),
            ("factory.engines.exl3.evaluate", "torch"),
            ("factory.engines.gguf.evaluate", "torch"),
            ("factory.engines.script", "torch"),
            ("factory.evaluation.evaluate", "torch"),
            ("factory.evaluation.evaluate", "transformers"),
            ("factory.checkpoints.inspection", "transformers"),
            ("factory.jobs.costs", "torch"),
            ("factory.evaluation.kld", "safetensors"),
            ("factory.evaluation.kld", "torch"),
            ("factory.evaluation.layered", "safetensors"),
            ("factory.evaluation.layered", "torch"),
            ("factory.evaluation.layered", "transformers"),
        ],
        _TORCH,
    ),
    **dict.fromkeys(
        [
            ("factory.evaluation.evaluate", "numpy"),
            ("factory.engines.exl3.engine", "numpy"),
            ("factory.engines.exl3.engine", "safetensors"),
            ("factory.engines.gguf.evaluate", "numpy"),
        ],
        _NUMPY,
    ),
    **dict.fromkeys(
        [
            ("factory.engines.awq.evaluate", "awq"),
            ("factory.engines.awq.quantize", "awq"),
            ("factory.engines.exl2.evaluate", "exllamav2"),
            ("factory.engines.exl2.ranges", "exllamav2"),
            ("factory.engines.exl3.compat", "exllamav3"),
            ("factory.engines.exl3.optimize", "exllamav3"),
            ("factory.engines.exl3.evaluate", "exllamav3"),
        ],
        _CUDA,
    ),
    ("factory.engines.awq_ct.quantize", "llmcompressor"): _LLMCOMPRESSOR,
    ("factory.engines.gguf.convert", "conversion"): "llama.cpp's converter package, on the path only once main() has "
    "put the pinned llama.cpp there",
    **dict.fromkeys(
        [
            ("factory.hubclient", "httpx2"),
            ("factory.hubclient", "huggingface_hub"),
            ("factory.publish.hub", "huggingface_hub"),
            ("factory.schedule", "huggingface_hub"),
            ("factory.checkpoints.sources", "huggingface_hub"),
        ],
        _HUB,
    ),
    ("factory.publish.card", "matplotlib"): _PLOT,
    **dict.fromkeys(
        [
            ("factory.cli.jobs", "factory.jobs.heartbeat"),
            ("factory.cli.registry", "factory.publish.housekeeping"),
            ("factory.cli.registry", "factory.publish.lookup"),
            ("factory.cli.registry", "factory.publish.folder"),
            ("factory.cli.registry", "factory.publish.card"),
            ("factory.cli.run", "factory.catalog"),
            ("factory.cli.run", "factory.jobs.heartbeat"),
            ("factory.cli.services", "factory.catalog.accounts"),
            ("factory.cli.shared", "factory.catalog"),
            ("factory.cli.shared", "factory.factory"),
            ("factory.cli.shared", "factory.service.client"),
            ("factory.submission", "factory.jobs.planning"),
        ],
        _CATALOG,
    ),
    **dict.fromkeys([("factory.catalog.status", "psycopg2"), ("factory.catalog.status", "redis")], _DRIVERS),
    ("factory.cli.services", "uvicorn"): _SERVER,
    ("factory.checkpoints.inspection", "factory.checkpoints.dequantize"): "a real cycle: " + CYCLES_INSPECT,
}


def _function_imports() -> dict[tuple[str, str], list[str]]:
    """(module, what it imports) -> where, for every import inside a function in factory/ and workers/; what it
    imports is the module of ours it names (`from factory.publish import lookup`: factory.publish.lookup), or else the
    third-party package (`from transformers.utils import logging`: transformers)."""
    ours = {name for name, _, _ in _modules()}
    found: dict[tuple[str, str], list[str]] = {}
    for name, path, tree in _modules():
        if name.split(".")[0] not in ("factory", "workers"):
            continue
        nodes = {
            node
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
            if isinstance(node, (ast.Import, ast.ImportFrom))
        }
        for node in nodes:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                names = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in ours else node.module for a in node.names
                ]
            for imported in names:
                if imported.split(".")[0] not in ("factory", "workers", "calibration"):
                    imported = imported.split(".")[0]
                found.setdefault((name, imported), []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_import_inside_a_function_has_its_reason():
    found = _function_imports()
    unlisted = {key: where for key, where in sorted(found.items()) if key not in FUNCTION_IMPORTS}
    assert unlisted == {}, (
        "an import inside a function without a reason in FUNCTION_IMPORTS: move it to the top of its module, or "
        f"add it there with why it cannot be (import cost, a real cycle): {unlisted}"
    )
    assert sorted(set(FUNCTION_IMPORTS) - set(found)) == [], "FUNCTION_IMPORTS lists imports that are gone"


def test_no_module_outside_the_engines_names_a_method():
    methods = set(engines.available())
    problems = []
    for name, path, tree in _modules():
        where = str(path.relative_to(ROOT))
        if name.startswith("factory.engines"):
            continue
        problems += [
            f"{where}:{node.lineno} {node.value!r}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in methods
        ]
    assert problems == []


# Import cycles that stay, each with why (issue 34): everything else imports only modules that do not import it back,
# at any depth and at any level (a function's imports count too).
CYCLES = {frozenset({"factory.checkpoints.inspection", "factory.checkpoints.dequantize"}): CYCLES_INSPECT}


def _depends_on(tree, modules: set[str]) -> set[str]:
    """The modules of `modules` a module imports: `from package import module` depends on that module only."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [s for s in subs if s in modules] or [node.module]
        else:
            continue
        for name in names:
            parts = name.split(".")
            found |= next(
                ({".".join(parts[:i])} for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), set()
            )
    return found


def test_no_module_imports_one_that_imports_it_back():
    trees = {name: tree for name, _, tree in _modules()}
    graph = {name: _depends_on(tree, set(trees)) - {name} for name, tree in trees.items()}
    cycles = set()
    for start in graph:  # every module that reaches back to `start`, and is reached from it
        reach, todo = set(), [start]
        while todo:
            for after in graph[todo.pop()] - reach:
                reach.add(after)
                todo.append(after)
        if start in reach:
            back = {m for m in reach if start in _reachable(graph, m)}
            cycles.add(frozenset(back | {start}))
    assert cycles == set(CYCLES), [sorted(c) for c in cycles - set(CYCLES)]


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    reach, todo = set(), [start]
    while todo:
        for after in graph[todo.pop()] - reach:
            reach.add(after)
            todo.append(after)
    return reach
