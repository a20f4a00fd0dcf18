"""Scoring AWQ quants on any device: AutoAWQ's own `dequantize_gemm` turns the packed weights back into a
transformers model (every other tensor comes from the AWQ file, which holds the norms AWQ folded its scales into).
AutoAWQ's loader (`from_quantized`) insists on intel_extension_for_pytorch on a CPU, which our torch lacks."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from factory.evaluate import quiet_transformers, torch_dtype, transformers_logits


def load(folder: Path, dev: str):
    """A transformers model whose quantized linears hold AutoAWQ's dequantized weights."""
    import warnings

    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    # autoawq's import resets the warning filters and warns of its deprecation in 15 lines: keep them in the log
    with warnings.catch_warnings(record=True) as caught:
        from awq.utils.packing_utils import dequantize_gemm
    log = logging.getLogger(__name__)
    for w in caught:  # the first import only: one line, and the notice itself for whoever logs at debug
        log.info("AutoAWQ is deprecated upstream and still works here (its notice: debug log)")
        log.debug("autoawq: %s", w.message)
    quiet_transformers()

    config_dict = json.loads((folder / "config.json").read_text())
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
