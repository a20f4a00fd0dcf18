"""Scoring AWQ-CT quants on any device: compressed-tensors' own decompressor (the pack-quantized one, with the scheme
the checkpoint's quantization_config names) turns each quantized Linear's `weight_packed`, `weight_scale`,
`weight_zero_point` and `weight_shape` back into a weight, and transformers runs the unquantized model.

Not transformers' own loader: it loads dense asymmetric checkpoints only up to 5.22 (5.23 to 5.25 refuse the packed
zero points: "size mismatch ... weight_zero_point") and no asymmetric mixture of experts at all (its expert
decompression leaves the zero points out: "Asymmetric quant requires zero-point values"; transformers PR #47430).
Where the architecture allows, the model is walked layer by layer and each layer's weights are unpacked as it is
reached (factory/evaluation/layered.py); the others (mixtures of experts) are unpacked into an unquantized checkpoint in
a temporary folder, which transformers loads as it loads the source (it fuses the experts itself).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from factory.evaluation.evaluate import Model, auto_model, quiet_transformers, torch_dtype, transformers_logits
from factory.evaluation.layered import ByLayer, Tensors, walkable

PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")


class Decompressed(Tensors):
    """A compressed-tensors checkpoint's tensors as the unquantized model names them: `<linear>.weight` unpacked from
    its parts when asked for (a layer at a time, for layered.ByLayer)."""

    def __init__(self, folder: Path):
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationScheme

        super().__init__(folder)
        qc = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]
        [group] = qc["config_groups"].values()  # the engine writes one group
        self.scheme = QuantizationScheme.model_validate(group)
        self.compressor = BaseCompressor.get_value_from_registry(group.get("format") or qc["format"])

    def _packed(self, name: str) -> str | None:
        base = name.removesuffix(".weight")
        return base if name.endswith(".weight") and super().__contains__(f"{base}.weight_packed") else None

    def __contains__(self, name: str) -> bool:
        return super().__contains__(name) or self._packed(name) is not None

    def get(self, name: str):
        base = self._packed(name)
        if base is None:
            return super().get(name)
        parts = {
            p: super(Decompressed, self).get(f"{base}.{p}")
            for p in PARTS
            if super(Decompressed, self).__contains__(f"{base}.{p}")
        }
        return self.compressor.decompress(parts, self.scheme)["weight"]

    def names(self) -> list[str]:
        """The unquantized checkpoint's tensor names."""
        names = []
        for name in self.files:
            if name.endswith(".weight_packed"):
                names.append(name.removesuffix("_packed"))
            elif not name.endswith(PARTS):
                names.append(name)
        return sorted(names)


def load(folder: Path, dev: str) -> Model:
    """The quant as an unquantized model holding the decompressed weights: walked layer by layer where its
    architecture allows, else a whole transformers model."""
    quiet_transformers()
    if walkable(json.loads((Path(folder) / "config.json").read_text())):
        return ByLayer.of(folder, dev, torch_dtype(dev), Decompressed(folder))
    return load_whole(folder, dev)


def load_whole(folder: Path, dev: str) -> Model:
    """The whole decompressed model in transformers, loaded from an unquantized copy of the checkpoint."""
    from safetensors.torch import save_file

    tensors = Decompressed(folder)
    config = json.loads((Path(folder) / "config.json").read_text())
    config.pop("quantization_config")
    with tempfile.TemporaryDirectory(prefix="awqct-") as tmp:
        state = {name: tensors.get(name).contiguous() for name in tensors.names()}
        save_file(state, Path(tmp) / "model.safetensors", metadata={"format": "pt"})
        del state
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        model = auto_model(config).from_pretrained(tmp, dtype=torch_dtype(dev), trust_remote_code=False)
    return transformers_logits(model, dev)
