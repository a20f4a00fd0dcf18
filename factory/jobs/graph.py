"""The units of a job after its inspect step, and what each needs first. A unit's name is the catalog's step name.

    <stage>:<key>          an engine's shared units (engines.Shared: EXL2's `measure`, GGUF's `convert` then
                           `imatrix`, EXL3's `measure-kld`), once per key, each after the stage before it and after
                           the quants its spec is made from (Engine.made_from: EXL3's optimized size's uniform ones)
    quantize:<tag>         after its engine's shared units, if it has any, and the quants it is made from
    evaluate:fp16          once per job (reused across jobs by the catalog's baseline and its KL reference)
    evaluate:<tag>         after quantize:<tag> and evaluate:fp16 (its KL divergence reads FP16's reference)
    evaluate:<tag>:<group> the engine's other scores (a quantized KV cache's), after quantize:<tag>
    gate                   after every evaluation
    publish:<tag>          after the gate (a GPU worker's job stops before: a CPU worker publishes)
    push:<tag>             after publish:<tag>, when the factory pushes to the Hub

Units come in the order the steps ran one after another before packing existed, so one unit at a time
(`--max-units 1`) runs them exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

from factory import engines
from factory.engines import QuantSpec


@dataclass(frozen=True)
class Unit:
    name: str
    kind: str
    needs: frozenset[str] = frozenset()
    spec: QuantSpec | None = None
    group: str | None = None  # evaluate:<tag>:<group>: the engine's evaluation group
    measurement: str | None = None  # a shared unit (kind `measure`, named <stage>:<key>): its full key

    @property
    def stage(self) -> str:
        """A shared unit's stage (`measure`, `convert`, `imatrix`): its name before the key."""
        return self.name.partition(":")[0]


def units(specs: list[QuantSpec], measurement_keys: dict[str, dict[str, str]], publish: bool, push: bool) -> list[Unit]:
    """`measurement_keys`: tag -> {stage: key} in the engine's order, for the specs whose engine has shared units."""
    made: dict[str, Unit] = {}

    def add(unit: Unit) -> None:
        made.setdefault(unit.name, unit)

    for spec in specs:
        inputs = [f"quantize:{s.tag}" for s in engines.get(spec.method).made_from(spec)]
        shared: list[str] = []
        for stage, key in measurement_keys.get(spec.tag, {}).items():
            name = f"{stage}:{key[:12]}"
            add(Unit(name, "measure", frozenset([*shared[-1:], *inputs]), spec, measurement=key))
            shared.append(name)
        add(Unit(f"quantize:{spec.tag}", "quantize", frozenset([*shared, *inputs]), spec))
    add(Unit("evaluate:fp16", "evaluate"))
    for spec in specs:
        add(Unit(f"evaluate:{spec.tag}", "evaluate", frozenset({f"quantize:{spec.tag}", "evaluate:fp16"}), spec))
    for spec in specs:
        for group in dict.fromkeys(e.group for e in engines.get(spec.method).evaluations(spec)):
            add(
                Unit(
                    f"evaluate:{spec.tag}:{group.split('_')[0]}",
                    "evaluate",
                    frozenset({f"quantize:{spec.tag}"}),
                    spec,
                    group=group,
                )
            )
    add(Unit("gate", "gate", frozenset(n for n, u in made.items() if u.kind == "evaluate")))
    if publish:
        for spec in specs:
            add(Unit(f"publish:{spec.tag}", "publish", frozenset({"gate"}), spec))
            if push:
                add(Unit(f"push:{spec.tag}", "push", frozenset({f"publish:{spec.tag}"}), spec))
    return list(made.values())
