"""Refuse checkpoints that cannot work, before any engine starts (ModelRefused, exit 3).

Reads config.json, the tokenizer's presence and every safetensors header; never loads weights. Refused:
no or unparsable config.json, an already quantized model, custom code (`auto_map`), weights only as pickle,
no weights, a truncated or unparsable safetensors file, shards that disagree with the index, no tokenizer,
an architecture outside SUPPORTED. The numbers the engines need later (input dims of the quantized
linears, sizes) come from here.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from factory.errors import ModelRefused

# Architectures both engines (AutoAWQ 0.2.9 and exllamav2 0.3.2) convert, as `architectures[0]` -> model_type.
SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GemmaForCausalLM": "gemma",
    "Gemma2ForCausalLM": "gemma2",
    "Phi3ForCausalLM": "phi3",
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    model_type: str
    config: dict
    weight_files: list[str]
    weight_bytes: int
    in_features: list[int]  # input dims of the linears the engines quantize
    max_positions: int | None


def inspect(folder: Path) -> ModelInfo:
    config = _config(folder)
    if "auto_map" in config or _tokenizer_auto_map(folder):
        raise ModelRefused(
            "the model needs custom code (auto_map); only architectures built into transformers are allowed"
        )
    if "quantization_config" in config:
        method = (config["quantization_config"] or {}).get("quant_method", "unknown")
        raise ModelRefused(f"config.json says the model is already quantized ({method}); pass the FP16 checkpoint")
    arch = (config.get("architectures") or [None])[0]
    if arch not in SUPPORTED:
        raise ModelRefused(f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED)}")
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        if any(p.suffix in PICKLE_SUFFIXES for p in folder.iterdir()):
            raise ModelRefused("the weights are only in pickle files (.bin/.pt); convert them to safetensors first")
        raise ModelRefused(f"no safetensors weights in {str(folder)!r}")
    if not any((folder / t).is_file() for t in ("tokenizer.json", "tokenizer.model")):
        raise ModelRefused("no tokenizer (tokenizer.json or tokenizer.model) beside the weights")
    headers = {name: read_header(folder / name) for name in files}
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        _check_index(index, headers)
    tensors = {k: v for h in headers.values() for k, v in h.items()}
    in_features = sorted(
        {
            info["shape"][1]
            for key, info in tensors.items()
            if len(info["shape"]) == 2 and key.endswith(".weight") and key.split(".")[-2] in QUANTIZED_LINEARS
        }
    )
    if not in_features:
        raise ModelRefused(f"no quantizable linear layers ({', '.join(QUANTIZED_LINEARS)}) in the weights")
    return ModelInfo(
        architecture=arch,
        model_type=SUPPORTED[arch],
        config=config,
        weight_files=files,
        weight_bytes=sum((folder / f).stat().st_size for f in files),
        in_features=in_features,
        max_positions=config.get("max_position_embeddings"),
    )


def _config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelRefused(f"no config.json in {str(folder)!r}; pass a Hugging Face checkpoint folder")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelRefused(f"config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelRefused("config.json is not a JSON object")
    return config


def _tokenizer_auto_map(folder: Path) -> bool:
    try:
        return "auto_map" in json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensor table, checked against the file's real size (truncation shows here)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelRefused(f"{path.name} is truncated: {size} bytes, not even a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ModelRefused(f"{path.name} is not a safetensors file or is truncated (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ModelRefused(f"{path.name} has an unparsable safetensors header") from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    end = 0
    for key, info in header.items():
        try:
            begin, stop = info["data_offsets"]
            count = 1
            for d in info["shape"]:
                count *= d
            expected = count * DTYPE_BYTES.get(info["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            raise ModelRefused(f"{path.name} has an unparsable entry for tensor {key!r}") from None
        if expected and stop - begin != expected:
            raise ModelRefused(f"{path.name}: tensor {key!r} has {stop - begin} bytes, its shape needs {expected}")
        end = max(end, stop)
    if end != data:
        raise ModelRefused(f"{path.name} is truncated or padded: its tensors need {end} bytes of data, it holds {data}")
    return header


def _check_index(index: Path, headers: dict[str, dict]) -> None:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError):
        raise ModelRefused(f"{index.name} is not a valid safetensors index") from None
    missing = sorted({f for f in weight_map.values() if f not in headers})
    if missing:
        raise ModelRefused(f"{index.name} names shards that are not there: {', '.join(missing[:3])}")
    for tensor, shard in weight_map.items():
        if tensor not in headers[shard]:
            raise ModelRefused(f"{index.name} puts tensor {tensor!r} in {shard}, which does not hold it")
    listed = {f for f in weight_map.values()}
    for shard, header in headers.items():
        extra = [t for t in header if weight_map.get(t) != shard]
        if shard in listed and extra:
            raise ModelRefused(f"{shard} holds tensor {extra[0]!r}, which {index.name} does not put there")
