"""EXL3 quant folders laid out as exllamav3 1.6.5 writes them, and a measurement of them as its measure writes one:
the inputs of exllamav3's optimize, for CPU tests of the optimized size (tests/integration/test_exl3_optimize.py).

A quant of a Llama-shaped FP16 folder at K bits: each decoder linear as `<key>.trellis` (int16, in/16 x out/16 x 16K:
K bits a weight), `.suh` and `.svh` (fp16 sign vectors) and the `.mul1` codebook marker, the head likewise at its
head bits, every other tensor copied; config.json with its quantization_config. Every trellis word holds K, so a test
reads which input each tensor of an assembled quant came from. Nothing decodes them: exllamav3's optimize reads
headers and copies tensors (tests/support/exl3_cpu.py runs it without a GPU).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from factory.checkpoints.inspection import read_header

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MUL1 = np.array(0x83DCD12D, dtype=np.uint32).view(np.int32)  # exllamav3's codebook_mul1_mult, as it stores it
PAD = 128  # exllamav3 counts a linear's weights at its padded shape (modules/linear.py)


def _exl3(key: str, weight: np.ndarray, bits: int) -> dict[str, np.ndarray]:
    out_features, in_features = weight.shape
    return {
        f"{key}.trellis": np.full((in_features // 16, out_features // 16, 16 * bits), bits, dtype=np.int16),
        f"{key}.suh": np.ones(in_features, dtype=np.float16),
        f"{key}.svh": np.ones(out_features, dtype=np.float16),
        f"{key}.mul1": MUL1,
    }


def quant(source: Path, out: Path, bits: int, head_bits: int = 6) -> Path:
    out.mkdir(parents=True)
    for f in source.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    tensors = {}
    for name, t in load_file(str(source / "model.safetensors")).items():
        key = name.removesuffix(".weight")
        if key.rpartition(".")[2] in LINEARS:
            tensors.update(_exl3(key, t, bits))
        elif key == "lm_head":
            tensors.update(_exl3(key, t, head_bits))
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "exl3",
        "version": "1.6.5",
        "bits": float(bits),
        "head_bits": head_bits,
        "codebook": "mul1",
    }
    (out / "config.json").write_text(json.dumps(config, indent=4))
    (out / "quantization_config.json").write_text("{}")
    return out


def groups(layers: int) -> list[list[str]]:
    """The groups exllamav3's measure forms of a Llama layer at its level 2: the attention's tensors, the MLP's."""
    found = []
    for i in range(layers):
        found.append([f"model.layers.{i}.self_attn.{p}" for p in LINEARS[:4]])
        found.append([f"model.layers.{i}.mlp.{p}" for p in LINEARS[4:]])
    return found


def storage_bits(folder: Path, key: str) -> int:
    """What exllamav3 counts a module's storage as: its tensors' bytes, in bits (Linear.storage_size() * 8)."""
    header = read_header(folder / "model.safetensors")
    return 8 * sum(i["data_offsets"][1] - i["data_offsets"][0] for k, i in header.items() if k.startswith(f"{key}."))


def bpw(folder: Path, layers: int) -> float:
    """Model.get_storage_info()'s bits per weight of the decoder linears, at their padded shapes."""
    header = read_header(folder / "model.safetensors")
    keys = [k for g in groups(layers) for k in g]
    numel = 0
    for key in keys:
        in_features, out_features, _ = header[f"{key}.trellis"]["shape"]
        numel += math.ceil(in_features * 16 / PAD) * PAD * math.ceil(out_features * 16 / PAD) * PAD
    return sum(storage_bits(folder, k) for k in keys) / numel


def measurement(inputs: list[Path], layers: int, dkld: list[list[float]]) -> dict:
    """What exllamav3's measure writes for `inputs` (lowest bits first): each group's candidates, one per input after
    the first, with `dkld[group][candidate]` as their KL divergence change and their real bits as `dbits`."""
    found = groups(layers)
    return {
        "base": {"dir": "/measured/elsewhere/0", "bpw": bpw(inputs[0], layers)},
        "alts": [{"dir": f"/measured/elsewhere/{i}", "bpw": bpw(q, layers)} for i, q in enumerate(inputs[1:], 1)],
        "groups": [
            {
                "idx": g,
                "layers": keys,
                "candidates": [
                    {
                        "dkld": dkld[g][c],
                        "dbits": sum(storage_bits(q, k) - storage_bits(inputs[0], k) for k in keys),
                    }
                    for c, q in enumerate(inputs[1:])
                ],
            }
            for g, keys in enumerate(found)
        ],
        "base_kld": 0.25,
        "arch_string": "LlamaForCausalLM",
    }
