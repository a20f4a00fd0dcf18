"""The units of a job after its inspect step, and what each needs first. A unit's name is the catalog's step name.

    measure:<key>          once per measurement key (engines with a measurement)
    quantize:<tag>         after its measurement, if it has one
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
    measurement: str | None = None  # measure:<key>: the full key; quantize:<tag>: the unit it needs


def units(specs: list[QuantSpec], measurement_keys: dict[str, str], publish: bool, push: bool) -> list[Unit]:
    """`measurement_keys`: tag -> measurement key, for the specs whose engine measures."""
    made: dict[str, Unit] = {}

    def add(unit: Unit) -> None:
        made.setdefault(unit.name, unit)

    for spec in specs:
        needs = frozenset()
        if key := measurement_keys.get(spec.tag):
            measure = f"measure:{key[:12]}"
            add(Unit(measure, "measure", spec=spec, measurement=key))
            needs = frozenset({measure})
        add(Unit(f"quantize:{spec.tag}", "quantize", needs, spec, measurement=next(iter(needs), None)))
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
