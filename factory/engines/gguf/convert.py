"""llama.cpp's convert_hf_to_gguf.py, run as __main__ with the pinned llama.cpp's own `conversion` and `gguf-py` first
on the path (not the `gguf` package a venv may hold):

    python -m factory.engines.gguf.convert LLAMA_CPP_DIR SRC --outtype f16 --outfile OUT.gguf

One thing added: the converter names a BPE vocabulary's pre-tokenizer by hashing how it tokenizes a test string, so
a vocabulary it has not seen (a tokenizer trained here, as the tests' tiny model's) is refused even when its
pre-tokenizer is GPT-2's exactly. Where the source's tokenizer.json says so (a lone ByteLevel with GPT-2's regex, no
prefix space), an unrecognized hash is taken as llama.cpp's `gpt-2`; any other is still refused.

And the source read as its release wrote it where transformers 5 reads it otherwise: the keys of config.json that
AutoConfig renames or folds away (with_release_keys), and Granite 4.0-H's layer types as transformers 5 saves them
(with_saved_layer_types).

And one thing passed on: a converter class that exports a multi-token-prediction head (Qwen3.5, Qwen3-Next, GLM-4.5,
DeepSeek-V3) asserts that the checkpoint holds one unless told `--no-mtp`; a checkpoint saved by transformers (a
fine-tune) has none, since transformers drops those layers on load. Where the source holds no such tensors (`mtp.*`,
or a layer past num_hidden_layers) the converter is told so.
"""

from __future__ import annotations

import json
import re
import runpy
import struct
import sys
from pathlib import Path

LAYER = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")  # the language model's, not a vision tower's


def gpt2_pre_tokenizer(source: Path) -> bool:
    try:
        pre = json.loads((source / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return False
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False)


def tensor_names(source: Path) -> list[str]:
    """The tensor names of the source's safetensors files, from their headers."""
    names = []
    for path in sorted(source.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names += [n for n in json.loads(f.read(size)) if n != "__metadata__"]
    return names


def has_draft_layers(source: Path) -> bool:
    """The source holds a multi-token-prediction head: `mtp.*` tensors (Qwen's releases) or a layer numbered past
    num_hidden_layers (DeepSeek's and GLM's nextn layers)."""
    config = json.loads((source / "config.json").read_text())
    layers = config.get("text_config", config).get("num_hidden_layers", 0)
    for name in tensor_names(source):
        found = LAYER.search(name)
        if name.startswith("mtp.") or ".mtp." in name or (found and int(found.group(1)) >= layers):
            return True
    return False


def without_draft(llama_dir: Path, source: Path, args: list[str]) -> list[str]:
    """`args` with `--no-mtp` where the converter's class exports a draft head the source does not hold."""
    if "--mmproj" in args or {"--mtp", "--no-mtp", "--no-nextn"} & set(args):
        return args
    from conversion import get_model_class

    architecture = json.loads((source / "config.json").read_text())["architectures"][0]
    try:
        exports = get_model_class(architecture, mmproj=False).supports_mtp_export
    except NotImplementedError:  # the converter says so itself
        return args
    return [*args, "--no-mtp"] if exports and not has_draft_layers(source) else args


def with_release_keys(load):
    """The converter's load_hparams, with what the source's config.json says that AutoConfig's to_dict left out put
    back: the converter reads its hparams through transformers' config class, which in transformers 5 renames or folds
    away keys that some of its classes still ask for as the releases write them (Pythia's `rotary_pct`, inside
    rope_parameters now; Sarvam-MoE's `num_experts`, which transformers calls n_routed_experts). Only keys it lacks,
    nested configs too: what transformers says stays."""

    def load_hparams(dir_model: Path, is_mistral_format: bool):
        config = load(dir_model, is_mistral_format)
        path = Path(dir_model) / "config.json"
        if is_mistral_format or not path.is_file():
            return config
        put_back(config, json.loads(path.read_text()))
        return config

    return staticmethod(load_hparams)


def put_back(config: dict, raw: dict) -> None:
    for key, value in raw.items():
        if key not in config:
            config[key] = value
        elif isinstance(value, dict) and isinstance(config[key], dict):
            put_back(config[key], value)


def with_saved_layer_types(attention_layers):
    """GraniteHybridModel.get_attn_layers that also reads layer_types as transformers 5 saves them: Granite 4.0-H's
    releases say "attention" and "mamba", a checkpoint saved by transformers 5 (any fine-tune) "full_attention" and
    "linear_attention", where the converter found no attention layer and wrote every layer as Mamba (head_count_kv
    all 0, so llama.cpp reads the attention layers' tensors as a Mamba layer's)."""

    def get_attn_layers(self):
        types = self.hparams.get("layer_types") or []
        if "attention" not in types and "full_attention" in types:
            return [i for i, kind in enumerate(types) if kind == "full_attention"]
        return attention_layers(self)

    return get_attn_layers


def main() -> None:
    llama_dir, args = Path(sys.argv[1]), sys.argv[2:]
    sys.path[:0] = [str(llama_dir), str(llama_dir / "gguf-py")]
    from conversion import base, granite

    base.ModelBase.load_hparams = with_release_keys(base.ModelBase.load_hparams)
    granite.GraniteHybridModel.get_attn_layers = with_saved_layer_types(granite.GraniteHybridModel.get_attn_layers)
    if gpt2_pre_tokenizer(Path(args[0])):
        named = base.TextModel.get_vocab_base_pre

        def pre_tokenizer(self, tokenizer) -> str:
            try:
                return named(self, tokenizer)
            except NotImplementedError:
                return "gpt-2"

        base.TextModel.get_vocab_base_pre = pre_tokenizer
    args = without_draft(llama_dir, Path(args[0]), args)
    script = llama_dir / "convert_hf_to_gguf.py"
    sys.argv = [str(script), *args]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
