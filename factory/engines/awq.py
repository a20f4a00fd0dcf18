"""AWQ through AutoAWQ 0.2.9, in a child process (`python -m factory.engines.awq request.json`).

What the child does beyond calling AutoAWQ, and why:
- calibration arrives as token windows of exactly the requested length: AutoAWQ silently drops texts longer
  than max_calib_seq_len (and crashes if it drops all), so we never hand it raw text;
- `_ClonedStateQuantizer` clones the module state that `_compute_best_scale` saves before its grid search:
  AutoAWQ saves it with `.cpu()`, which on a CPU is the live tensor, so every grid step's scaling stayed in the
  weights (SmolLM2 on CPU: ppl 146,904 instead of 14.3). On CUDA `.cpu()` copies and the clone changes nothing;
- one progress event per decoder layer.
The parent checks the outputs instead of trusting the exit code.
"""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

from factory.engines import QuantizeRequest, check_quant_folder, child
from factory.files import COMPANIONS


class AwqEngine:
    name = "awq"
    requires_cuda = False
    needs_measurement = False
    default_calibration = "builtin:c4"
    outputs = ("*.safetensors", "model.safetensors.index.json")

    def version(self) -> str:
        return importlib.metadata.version("autoawq")

    def quantize(self, request: QuantizeRequest, emit) -> None:
        shutil.rmtree(request.out_dir, ignore_errors=True)
        child.run(
            __name__,
            {
                "source_dir": str(request.source_dir),
                "out_dir": str(request.out_dir),
                "spec": request.spec,
                "calibration": request.calibration,
            },
            request.work_dir,
            emit,
            what=f"AWQ quantization ({len(request.calibration)} x {len(request.calibration[0])} calibration tokens)",
        )
        check_output(request.out_dir, request.spec)
        for name in COMPANIONS:  # the tokenizer, chat template, ...: AutoAWQ writes only config and weights
            if (request.source_dir / name).is_file() and not (request.out_dir / name).exists():
                shutil.copyfile(request.source_dir / name, request.out_dir / name)


def check_output(out_dir: Path, spec: dict) -> None:
    want = {"quant_method": "awq", "bits": spec["w_bit"], "group_size": spec["group_size"]}
    check_quant_folder(out_dir, "*.safetensors", want, "AutoAWQ")


ENGINE = AwqEngine()


def _quantizer_cls(emit):
    from awq.quantize.quantizer import AwqQuantizer

    class _ClonedStateQuantizer(AwqQuantizer):
        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, linears2scale, fp16_output, kwargs={}):  # noqa: B006
            live = module2inspect.state_dict
            module2inspect.state_dict = lambda *a, **k: {n: t.detach().clone() for n, t in live(*a, **k).items()}
            try:
                return super()._compute_best_scale(
                    x, w_mean, x_mean, module2inspect, linears2scale, fp16_output, kwargs
                )
            finally:
                del module2inspect.state_dict

        def _get_input_feat(self, layer, named_linears):
            index = next(i for i, m in enumerate(self.modules) if m is layer)
            emit(event="progress", done=index, total=len(self.modules), unit="layer")
            return super()._get_input_feat(layer, named_linears)

    return _ClonedStateQuantizer


def main() -> None:
    emit = child.events()
    request = child.read_request()
    spec = request["spec"]
    calibration = request["calibration"]

    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    emit(event="progress", done=0, total=1, unit="load")
    model = AutoAWQForCausalLM.from_pretrained(request["source_dir"], trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(request["source_dir"], trust_remote_code=False)
    model.quantize(
        tokenizer,
        quant_config={
            "w_bit": spec["w_bit"],
            "q_group_size": spec["group_size"],
            "zero_point": spec["zero_point"],
            "version": spec["version"].upper(),
        },
        calib_data=calibration,
        max_calib_samples=len(calibration),
        max_calib_seq_len=len(calibration[0]),
        apply_clip=spec["clip"],
        quantizer_cls=_quantizer_cls(emit),
    )
    n = len(model.quantizer.modules)
    emit(event="progress", done=n, total=n, unit="layer")
    model.save_quantized(request["out_dir"])


if __name__ == "__main__":
    main()
