"""AWQ-CT specs: AWQ w4 with a zero point (W4A16 asymmetric) in compressed-tensors' pack-quantized format, a group
size, and the calibration llm-compressor's AWQModifier runs on."""

from __future__ import annotations

from typing import Literal

from factory.engines.awq.spec import W4Spec, group_size


class AwqCtSpec(W4Spec):
    """llm-compressor's AWQModifier, written as compressed-tensors."""

    LABEL = "AWQ-CT"
    method: Literal["awqct"] = "awqct"
    duo_scaling: bool = True  # AWQModifier's: scales from activations and weights (False: activations only)


def resolve(spec: AwqCtSpec, in_features: list[int], cuda: bool) -> AwqCtSpec:
    """Fill in the model- and device-dependent defaults but the calibration rows (awq.spec.calibration_rows, once
    the text is tokenized); refuse a group size that does not divide the dims."""
    return spec.model_copy(
        update={
            "group_size": group_size(spec.LABEL, spec.group_size, in_features),
            "calib_length": spec.calib_length or (512 if cuda else 128),
        }
    )
