"""An engine is the only place a method lives: one that exists only in tests/ runs `qf run` end to end, and the
import graph keeps its layers (a lower layer never imports a higher one)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from factory import engines
from factory.publish import card

ROOT = Path(__file__).resolve().parent.parent


def test_an_engine_from_tests_runs_end_to_end(qf, tiny, tmp_path, round_engine):
    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [3]}\n")
    result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 2)
    assert result.exit_code == 0, result.output
    [row] = qf.json("ls")
    assert (row["name"], row["method"], row["bits"]) == ("tiny:round-m3", "round", 9.0)
    assert row["fp16_ppl"] < row["ppl"] < 1.5 * row["fp16_ppl"]  # 3 mantissa bits cost something, not everything
    steps = {s["name"] for s in qf.json("status", row["job"])["steps"]}
    assert {"inspect", "quantize:round-m3", "evaluate:fp16", "evaluate:round-m3", "gate", "publish:round-m3"} <= steps
    result = qf("pull", "tiny:round-m3", "-o", tmp_path / "pulled")
    assert result.exit_code == 0, result.output
    pulled = tmp_path / "pulled"
    assert json.loads((pulled / "config.json").read_text())["quantization_config"]["quant_method"] == "round"
    text = (pulled / card.FILENAME).read_text()
    assert card.metadata(text)["library_name"] == "transformers" and "round" in card.metadata(text)["tags"]
    assert "transformers loads ./tiny-round-m3" in text
    logits = round_engine.load(pulled, "cpu")  # what was published is what was scored
    assert logits is not None


def test_an_unknown_engine_key_lists_the_registered_ones(qf, tiny, tmp_path, round_engine):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("rounds: {mantissa: [3]}\n")
    result = qf("run", tiny, "--recipe", recipe)
    assert result.exit_code == 2
    assert "unknown key 'rounds' (recipe keys: awq, awqct, exl2, exl3, round, calibration" in result.stderr


# -- layers -------------------------------------------------------------------------------------------------------
# Direction of knowledge: a module imports only modules of its own layer or a lower one, at module level
# or inside a function alike. The leaves import nothing but errors; engines never see the catalog or publishing.
LAYERS = [
    ["factory.errors"],
    [
        "factory.settings",
        "factory.specs",
        "factory.naming",
        "factory.files",
        "factory.tables",
        "factory.events",
        "factory.published",
        "factory.kld",
        "factory.layered",
        "calibration",
    ],
    [
        "factory.identity",
        "factory.inspect",
        "factory.dequantize",
        "factory.hubclient",
        "factory.catalog",
        "factory.status",
        "factory.evaluate",
        "factory.publish.upstream",
    ],
    ["factory.sources", "factory.vram"],
    ["factory.engines"],
    ["factory.recipes", "factory.schedule", "factory.publish", "factory.jobs"],
    ["factory.pipeline", "factory.housekeeping", "factory.leases", "factory.submission", "factory.lookup"],
    [
        "factory.cli",
        "factory.service",
        "workers",
    ],
]
LEAVES = {
    "factory.errors",
    "factory.settings",
    "factory.specs",
    "factory.naming",
    "factory.events",
    "factory.published",
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


@pytest.mark.parametrize(
    ("entry", "sentence"),
    [
        ("tests.round_engine:ENGINE", None),
        (
            "tests.nowhere:ENGINE",
            "FACTORY_ENGINES names 'tests.nowhere:ENGINE', which cannot be loaded: No module named",
        ),
        (
            "tests.round_engine:RoundSpec",
            "FACTORY_ENGINES names 'tests.round_engine:RoundSpec', which is not an engine",
        ),
    ],
)
def test_engines_named_in_the_environment(tmp_path, entry, sentence):
    """FACTORY_ENGINES registers engines in every process (workers and their job processes); one that cannot be
    loaded is one sentence and exit 2 at the first command, not a traceback at import."""
    env = {**os.environ, "FACTORY_ENGINES": entry, "FACTORY_HOME": str(tmp_path), "FACTORY_DB_URL": ""}
    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [3]}\n")
    result = subprocess.run(
        [sys.executable, "-m", "factory.cli", "run", str(tmp_path), "--recipe", str(recipe)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if sentence is None:  # registered: its recipe key is known (the folder is no model: refused by inspection)
        assert result.returncode == 3 and "config.json" in result.stderr, result.stderr
    else:
        assert result.returncode == 2 and sentence in result.stderr.strip().splitlines()[-1], result.stderr


def test_lower_layers_never_import_higher_ones():
    problems = []
    for name, _, tree in _modules():
        imported = {m for m in _imports(tree) if m.split(".")[0] in ("factory", "workers", "calibration")}
        imported = {m for m in imported if m != "factory"}  # `from factory import x` names x itself, listed too
        if name in LEAVES:
            problems += [f"{name} imports {m}" for m in imported if not m.startswith("factory.errors")]
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
CYCLES = {
    frozenset({"factory.inspect", "factory.dequantize"}): "inspect refuses a source it cannot read with dequantize's "
    "reasons (FP8, MXFP4, GGUF, quantized formats), and dequantize reads configs and headers with inspect's bounded "
    "readers: one function-level import, in inspect.inspect",
}


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
