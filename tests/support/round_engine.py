"""A test engine that lives only here, to prove that an engine is the only place a method lives: registered by
the test (factory.engines.register), it runs `qf run` end to end with no edit anywhere else.

It rounds every FP16 weight's mantissa to N bits (round-to-nearest, `torch.frexp`), in a child process of its own
(`python -m tests.support.round_engine request.json`), and writes a checkpoint transformers loads once its
quantization_config is set aside; a conversion takes at least $QF_TEST_ROUND_SECONDS (0), for tests that need one to
be running, and the one to $QF_TEST_ROUND_FAILS mantissa bits fails after its first tensor. Tags: `round-m<N>`;
recipe key `round: {mantissa: [3, 5]}`. Workers take it with FACTORY_ENGINES=tests.support.round_engine:ENGINE.
Two variants beside it: MEASURED (a measurement every size shares, as EXL2's) and MIXED (a size made from the job's
other sizes and kept only where it beats one of them, as EXL3's optimized size).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Literal

from pydantic import Field

from factory.checkpoints.files import COMPANIONS
from factory.engines import child
from factory.engines.base import Card, Engine, QuantizeRequest, QuantSpec, Shared, Targets, check_quant_folder
from factory.evaluation.evaluate import quiet_transformers, torch_dtype, transformers_logits


class RoundSpec(QuantSpec):
    method: Literal["round"] = "round"
    mantissa: int = Field(ge=1, le=10)

    @property
    def tag(self) -> str:
        return f"round-m{self.mantissa}"

    @property
    def bits(self) -> float:
        return 6.0 + self.mantissa  # sign, five exponent bits, the mantissa kept


class RoundTargets(Targets):
    mantissa: list[int] = Field(min_length=1)

    def specs(self) -> list[RoundSpec]:
        return [RoundSpec(mantissa=m) for m in sorted(set(self.mantissa))]


class RoundCard(Card):
    library_name = "transformers"
    hub_repo = "{owner}/{model}-round"

    def how_to_load(self, folder: str) -> str:
        return f"```python\n# transformers loads ./{folder} once quantization_config is removed from its config\n```\n"


class RoundEngine(Engine):
    name = "round"
    label = "ROUND"
    spec = RoundSpec
    targets = RoundTargets
    tag_pattern = r"round-m\d+"
    tag_example = "round-m3"
    architectures = frozenset({"LlamaForCausalLM"})
    outputs = ("model.safetensors",)
    evaluator = "transformers"
    Card = RoundCard

    def version(self) -> str:
        return "1"

    def quantize(self, request: QuantizeRequest, emit) -> None:
        shutil.rmtree(request.out_dir, ignore_errors=True)
        payload = {
            "source_dir": str(request.source_dir),
            "out_dir": str(request.out_dir),
            "spec": request.spec.model_dump(),
            "seconds": float(os.environ.get("QF_TEST_ROUND_SECONDS", "0")),
            "fails": str(request.spec.mantissa) == os.environ.get("QF_TEST_ROUND_FAILS"),
        }
        child.run(__name__, payload, request.work_dir, emit, what=f"rounding to {request.spec.mantissa} bits")
        check_quant_folder(
            request.out_dir,
            "model.safetensors",
            {"quant_method": "round", "mantissa": request.spec.mantissa},
            "the round engine",
        )

    def load(self, folder: Path, device: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        quiet_transformers()
        config = json.loads((folder / "config.json").read_text())
        config.pop("quantization_config")
        model = AutoModelForCausalLM.from_pretrained(
            folder, config=AutoConfig.for_model(**config), dtype=torch_dtype(device)
        )
        return transformers_logits(model, device)


ENGINE = RoundEngine()


class MeasuredSpec(RoundSpec):
    method: Literal["mround"] = "mround"  # type: ignore[assignment]

    @property
    def tag(self) -> str:
        return f"mround-m{self.mantissa}"


class MeasuredTargets(RoundTargets):
    def specs(self) -> list[MeasuredSpec]:
        return [MeasuredSpec(mantissa=m) for m in sorted(set(self.mantissa))]


class MeasuredCard(RoundCard):
    hub_repo = "{owner}/{model}-mround"


class MeasuredRoundEngine(RoundEngine):
    """The round engine with a measurement, as EXL2 has, that every size of a model shares: it takes
    $QF_TEST_MEASURE_SECONDS (4; a child that reports progress), and the conversion needs its file."""

    name = "mround"
    label = "MROUND"
    spec = MeasuredSpec
    targets = MeasuredTargets
    tag_pattern = r"mround-m\d+"
    tag_example = "mround-m3"
    Card = MeasuredCard
    shared = (Shared("measure", "measurement", ".json"),)

    @property
    def measure_seconds(self) -> float:
        return float(os.environ.get("QF_TEST_MEASURE_SECONDS", "4"))

    def measurement_settings(self, spec, stage: str) -> tuple[int, int]:
        return 2, 16

    def measure(
        self,
        stage,
        source_dir: Path,
        calibration_file: Path,
        rows: int,
        length: int,
        work_dir: Path,
        measurement: Path,
        earlier,
        emit,
        processes: int = 1,
    ) -> None:
        payload = {"measure": str(measurement), "seconds": self.measure_seconds}
        child.run(__name__, payload, work_dir, emit, what="measuring")

    def quantize(self, request: QuantizeRequest, emit) -> None:
        made = request.measurements.get("measure")
        if made is None or "measurement" not in json.loads(made.read_text()):
            raise AssertionError(f"no measurement for {request.spec}")
        super().quantize(request, emit)  # its quants are the round engine's


MEASURED = MeasuredRoundEngine()


class MixSpec(RoundSpec):
    method: Literal["xround"] = "xround"  # type: ignore[assignment]
    mix: bool = False

    @property
    def tag(self) -> str:
        return f"xround-m{self.mantissa}" + ("-mix" if self.mix else "")


class MixTargets(Targets):
    mantissa: list[int] = Field(default_factory=list)
    mix: list[int] = Field(default_factory=list)

    def specs(self) -> list[MixSpec]:
        uniform = sorted({*self.mantissa, *(m + d for m in self.mix for d in (-1, 0, 1))})
        return [MixSpec(mantissa=m) for m in uniform] + [MixSpec(mantissa=m, mix=True) for m in sorted(set(self.mix))]


class MixCard(RoundCard):
    hub_repo = "{owner}/{model}-xround"


class MixedRoundEngine(RoundEngine):
    """The round engine with a mixed size (`xround: {mix: [4]}`, tag `xround-m4-mix`) made from the job's sizes a
    mantissa bit below, at and above it (Engine.made_from), as EXL3's optimized size is made from its uniform ones:
    its measurement (a shared unit) reads those quants' folders and lists them, and its quant is the one above when
    its mantissa is in $QF_TEST_MIX_ABOVE (comma-separated), else the one below. The gate keeps it only where it beats
    the size of its own mantissa (Engine.rival): the one above does (a lower KLD in as many bytes), the one below
    does not."""

    name = "xround"
    label = "XROUND"
    spec = MixSpec
    targets = MixTargets
    tag_pattern = r"xround-m\d+(-mix)?"
    tag_example = "xround-m3"
    Card = MixCard
    shared = (Shared("mixmeasure", "mix measurement", ".json"),)

    def shared_units(self, spec: MixSpec) -> tuple[Shared, ...]:
        return self.shared if spec.mix else ()

    def made_from(self, spec: MixSpec) -> list[MixSpec]:
        return [MixSpec(mantissa=spec.mantissa + d) for d in (-1, 0, 1)] if spec.mix else []

    def rival(self, spec: MixSpec) -> MixSpec | None:
        return MixSpec(mantissa=spec.mantissa) if spec.mix else None

    def measurement_settings(self, spec, stage: str) -> tuple[int, int]:
        return 2, 16

    def measure(
        self,
        stage,
        source_dir: Path,
        calibration_file: Path,
        rows: int,
        length: int,
        work_dir: Path,
        measurement: Path,
        earlier,
        emit,
        processes: int = 1,
    ) -> None:
        missing = [tag for tag, folder in earlier.items() if not (folder / "model.safetensors").is_file()]
        if missing:
            raise AssertionError(f"measured before its inputs were made: {missing}")
        measurement.write_text(json.dumps({"inputs": list(earlier)}))

    def quantize(self, request: QuantizeRequest, emit) -> None:
        spec = request.spec
        if not spec.mix:
            return super().quantize(request, emit)
        measured = json.loads(request.measurements["mixmeasure"].read_text())["inputs"]
        if measured != list(request.quants) or measured != [s.tag for s in self.made_from(spec)]:
            raise AssertionError(f"{spec.tag} measured {measured}, given {list(request.quants)}")
        above = str(spec.mantissa) in os.environ.get("QF_TEST_MIX_ABOVE", "").split(",")
        shutil.rmtree(request.out_dir, ignore_errors=True)
        shutil.copytree(request.quants[measured[2 if above else 0]], request.out_dir)
        check_quant_folder(request.out_dir, "model.safetensors", {"quant_method": "round"}, "the mixed round engine")


MIXED = MixedRoundEngine()


def main() -> None:
    emit = child.events()
    request = child.read_request()
    if "measure" in request:  # MeasuredRoundEngine's measurement: it takes its time, and says so
        steps = 20
        for i in range(steps):
            time.sleep(request["seconds"] / steps)
            emit(event="progress", done=i + 1, total=steps, unit="step")
        Path(request["measure"]).write_text(json.dumps({"measurement": {"made_by": os.getpid()}}))
        return
    import torch
    from safetensors.torch import load_file, save_file

    source, out, bits = Path(request["source_dir"]), Path(request["out_dir"]), request["spec"]["mantissa"]
    tensors = load_file(source / "model.safetensors")
    rounded = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        mantissa, exponent = torch.frexp(t.float())
        rounded[name] = torch.ldexp(torch.round(mantissa * 2**bits) / 2**bits, exponent).to(t.dtype).contiguous()
        emit(event="progress", done=i + 1, total=len(tensors), unit="tensor")
        if request.get("fails"):
            raise RuntimeError("asked to fail (QF_TEST_ROUND_FAILS)")
        time.sleep(request.get("seconds", 0) / len(tensors))
    out.mkdir(parents=True)
    save_file(rounded, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "round", "mantissa": bits}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in COMPANIONS:
        if (source / name).is_file() and not (out / name).exists():
            shutil.copyfile(source / name, out / name)


if __name__ == "__main__":
    main()
