"""Scoring AWQ quants on any device: AutoAWQ's own `dequantize_gemm` turns the packed weights back into a
transformers model (every other tensor comes from the AWQ file, which holds the norms AWQ folded its scales into).
AutoAWQ's loader (`from_quantized`) insists on intel_extension_for_pytorch on a CPU, which our torch lacks. Where the
architecture allows, the model is walked layer by layer and each layer's weights are unpacked as it is reached, so
memory holds one layer, not the model."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

from factory.evaluation.evaluate import Model, quiet_transformers, torch_dtype, transformers_logits
from factory.evaluation.layered import ByLayer, Tensors, walkable


def _dequantize_gemm():
    """AutoAWQ's unpacking (its import resets the warning filters and warns of its deprecation in 15 lines: keep
    them in the log)."""
    with warnings.catch_warnings(record=True) as caught:
        from awq.utils.packing_utils import dequantize_gemm
    log = logging.getLogger(__name__)
    for w in caught:  # the first import only: one line, and the notice itself for whoever logs at debug
        log.info("AutoAWQ is deprecated upstream and still works here (its notice: debug log)")
        log.debug("autoawq: %s", w.message)
    return dequantize_gemm


class Dequantized(Tensors):
    """An AWQ checkpoint's tensors as the unquantized model names them: `<linear>.weight` unpacked from its
    qweight, qzeros and scales when asked for (a layer at a time, for layered.ByLayer)."""

    def __init__(self, folder: Path):
        super().__init__(folder)
        qc = json.loads((folder / "config.json").read_text())["quantization_config"]
        self.bits, self.group_size = qc["bits"], qc["group_size"]
        self.unpack = _dequantize_gemm()

    def __contains__(self, name: str) -> bool:
        return super().__contains__(name) or super().__contains__(name.removesuffix(".weight") + ".qweight")

    def get(self, name: str):
        base = name.removesuffix(".weight")
        if not super().__contains__(f"{base}.qweight"):
            return super().get(name)
        parts = [super(Dequantized, self).get(f"{base}.{part}") for part in ("qweight", "qzeros", "scales")]
        return self.unpack(*parts, self.bits, self.group_size).T.contiguous()


def load(folder: Path, dev: str) -> Model:
    """The quant as an unquantized model holding AutoAWQ's dequantized weights: walked layer by layer where its
    architecture allows (factory/evaluation/layered.py), else a whole transformers model."""
    quiet_transformers()
    if walkable(json.loads((folder / "config.json").read_text())):
        return ByLayer.of(folder, dev, torch_dtype(dev), Dequantized(folder))
    return load_whole(folder, dev)


def load_whole(folder: Path, dev: str) -> Model:
    """The whole dequantized model in transformers."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = json.loads((folder / "config.json").read_text())
    dequantize_gemm = _dequantize_gemm()
    qc = config_dict.pop("quantization_config")
    config = AutoConfig.for_model(**config_dict)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(f))
    state = {}
    for key, value in tensors.items():
        if key.endswith(".qweight"):
            base = key.removesuffix(".qweight")
            weight = dequantize_gemm(
                value, tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], qc["bits"], qc["group_size"]
            )
            state[f"{base}.weight"] = weight.T.contiguous()
        elif not key.endswith((".qzeros", ".scales")):
            state[key] = value
    model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dev), trust_remote_code=False)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"AWQ tensors do not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return transformers_logits(model, dev)
