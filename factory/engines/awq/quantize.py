"""The AWQ child process: `python -m factory.engines.awq.quantize request.json` (factory/engines/awq/engine.py
starts it; nothing imports this module but the tests).

What it does beyond calling AutoAWQ, and why:
- calibration arrives as token windows of exactly the requested length: AutoAWQ silently drops texts longer
  than max_calib_seq_len (and crashes if it drops all), so we never hand it raw text;
- `_ClonedStateQuantizer` clones the module state that `_compute_best_scale` saves before its grid search:
  AutoAWQ saves it with `.cpu()`, which on a CPU is the live tensor, so every grid step's scaling stayed in the
  weights (SmolLM2 on CPU: ppl 146,904 instead of 14.3). On CUDA `.cpu()` copies and the clone changes nothing;
- on the CPU the model computes in float32 (float16 matmuls there are slow where the CPU has no float16 units: 11x
  bfloat16's time and 4x float32's on an AMD EPYC with AVX-512 BF16) and is cast back to the source's dtype before
  saving, so the scales and the unquantized tensors are stored as they were on CUDA (as AWQ-CT does);
- one progress event per decoder layer.
"""

from __future__ import annotations

import json
from pathlib import Path

from factory.engines import child


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

    import torch
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    emit(event="progress", done=0, total=1, unit="load")
    config = json.loads((Path(request["source_dir"]) / "config.json").read_text())
    saved = getattr(torch, child.saved_dtype(config))
    compute = "auto" if torch.cuda.is_available() else torch.float32
    model = AutoAWQForCausalLM.from_pretrained(request["source_dir"], torch_dtype=compute, trust_remote_code=False)
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
    model.model.to(saved)
    model.save_quantized(request["out_dir"])
    child.report_peak(emit)


if __name__ == "__main__":
    main()
