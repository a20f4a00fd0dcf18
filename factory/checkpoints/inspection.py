"""Refuse checkpoints that cannot work, before any engine starts (ModelRefused, exit 3).

Reads config.json, the tokenizer's presence and every safetensors header; never loads weights, and never opens a
file that factory/checkpoints/files.py has not checked is a regular file of the model. Refused: a link leaving the
folder, a FIFO, socket or device; no or unparsable config.json, an already quantized model, custom code (`auto_map`),
weights only as pickle, no weights, a truncated or malformed safetensors file, shards that disagree with the index,
no tokenizer, an architecture no engine converts, config numbers that are not sane integers or disagree with the
tensors, a config or headers larger, deeper or listing more tensors than a real model's (the bounds below), a
companion file (processor configs, chat templates, tokenizer files) larger or deeper than real ones or naming custom
code, and tensors that overlap or leave gaps in their file's data. Every header and config is validated before
anything is allocated from it. The numbers the engines need
later (input dims of the quantized linears, sizes) come from here.

`read_config` and `read_header` are the one reader of a config.json and of a safetensors header (`read_headers` of a
model's shards): inspection, `qf plan` (factory/vram.py) and the Hub's configs go through them.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path

from factory import identity
from factory.checkpoints.files import INDEX, source_files, write_atomic
from factory.errors import ModelRefused

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "C64": 8,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip
# Bounds on what a checkpoint's metadata may be, well above real models and far below what costs a process: the
# largest real checkpoints (DeepSeek-V3, Kimi K2: FP8 weights with their scales) list about 90k-140k tensors in
# all, over 60-160 shards of a few MB of header each; parsed, a header costs about 700 bytes a tensor (1M empty
# tensors: 700 MiB and 7 s in `qf plan`; the 1.7M in 96 MiB: 1.2 GB and 10 s). So: a header of at most
# 64 MiB, at most 256k tensors a shard (counted before parsing) and 512k a model (under 400 MB parsed).
MAX_HEADER = 64 << 20
MAX_TENSORS = 1 << 18
MAX_MODEL_TENSORS = 1 << 19
MAX_RANK = 8
MAX_CONFIG = 1 << 20  # real configs are a few KB; vision-language ones some tens of KB
MAX_METADATA = 64 << 20  # a safetensors index or tokenizer_config.json: real ones are at most a few MB
MAX_DEPTH = 32  # real configs nest 4 or 5 levels (text_config.rope_scaling.long_factor); headers 3
# The companions (factory/checkpoints/files.py) but config.json: the most bytes each may have, and what it is.
# Processor configs, chat templates and generation configs are a few KB (a template with tools some tens);
# tokenizers and vocabularies some MB (Gemma 3's tokenizer.json 33 MB).
COMPANION_BOUNDS = {
    "generation_config.json": (MAX_CONFIG, "a generation config"),
    "special_tokens_map.json": (MAX_CONFIG, "a special tokens map"),
    "chat_template.jinja": (MAX_CONFIG, "a chat template"),
    "chat_template.json": (MAX_CONFIG, "a chat template"),
    "preprocessor_config.json": (MAX_CONFIG, "a processor's config"),
    "processor_config.json": (MAX_CONFIG, "a processor's config"),
    "video_preprocessor_config.json": (MAX_CONFIG, "a processor's config"),
    "tokenizer_config.json": (MAX_METADATA, "a tokenizer's config"),
    "tokenizer.json": (MAX_METADATA, "a tokenizer"),
    "tokenizer.model": (MAX_METADATA, "a tokenizer"),
    "added_tokens.json": (MAX_METADATA, "a tokenizer's added tokens"),
    "vocab.json": (MAX_METADATA, "a vocabulary"),
    "merges.txt": (MAX_METADATA, "a tokenizer's merges"),
}
# The small JSON companions that are parsed here (the tokenizer's large files are left to the tokenizer), and those
# transformers would load custom code from (auto_map), as it would from config.json.
PARSED = (
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "tokenizer_config.json",
)
LOADS_CODE = (
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "tokenizer_config.json",
)
# The config numbers the factory sizes a model with: (required, lowest, highest allowed).
CONFIG_NUMBERS = {
    "hidden_size": (True, 1, 1 << 20),
    "num_hidden_layers": (True, 1, 4096),
    "num_attention_heads": (True, 1, 4096),
    "num_key_value_heads": (False, 1, 4096),
    "head_dim": (False, 1, 1 << 16),
    "intermediate_size": (True, 1, 1 << 22),
    "vocab_size": (True, 1, 1 << 24),
    "max_position_embeddings": (False, 1, 1 << 26),
}
# A decoder layer's tensors, as each family's transformers class names them: model.layers.N (Llama and most),
# model.decoder.layers.N (OPT), transformer.h.N (Falcon, GPT-J, Bloom, GPT-BigCode), transformer.blocks.N (MPT),
# gpt_neox.layers.N, backbone.layers.N (Nemotron-H); a vision-language model's language model as transformers 5
# saves it (model.language_model.layers.N) or as releases before it did (language_model.model.layers.N).
_LAYER = re.compile(
    r"(?:model\.(?:decoder\.|language_model\.)?|language_model\.model\.|transformer\.|gpt_neox\.|"
    r"backbone\.)?(?:layers|h|blocks)\.(\d+)\."
)
# A vision tower's numbers that the factory reads or shows, under each family's names: integers when present.
VISION_NUMBERS = (
    "hidden_size",
    "num_hidden_layers",
    "depth",
    "num_attention_heads",
    "num_heads",
    "intermediate_size",
    "patch_size",
    "image_size",
)
# The parts of a vision-language checkpoint that are not its language model: the vision tower (model.vision_tower,
# model.visual, model.vision_model) and the projector into the language model's embeddings (Gemma 4's
# model.embed_vision). They stay at 16 bits.
VISION_PARTS = ("vision_tower", "visual", "vision_model", "multi_modal_projector", "mm_projector", "embed_vision")
VISION_PART = re.compile(rf"(?:model\.)?({'|'.join(VISION_PARTS)})\.")
# Other names of the sizes, by family (the aliases transformers' configs map: GPT-J's n_embd, MPT's d_model, ...);
# read_config fills the standard name from the first alias present when the standard one is missing.
ALIASES = {
    "hidden_size": ("n_embd", "d_model", "n_embed"),
    "num_hidden_layers": ("n_layer", "n_layers", "num_layers"),
    "num_attention_heads": ("n_head", "n_heads", "num_heads"),
    "num_key_value_heads": ("num_kv_heads", "n_head_kv"),
    "intermediate_size": ("n_inner", "ffn_dim", "ffn_hidden_size"),
    "max_position_embeddings": ("n_positions", "max_seq_len", "seq_length"),
}


@dataclass(frozen=True)
class Vision:
    """A vision-language checkpoint's vision tower and projector: what they are and what they hold."""

    model_type: str  # the vision config's (siglip_vision_model, pixtral, qwen2_5_vl_vision, ...)
    parts: tuple[str, ...]  # their tensors' prefixes (model.vision_tower, model.multi_modal_projector)
    params: int
    layers: int | None


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    model_type: str
    config: dict  # the sizes are the language model's (with_standard_names), a composite config's text_config too
    weight_files: list[str]
    weight_bytes: int
    in_features: list[int]  # input dims of the linears the engines quantize
    max_positions: int | None
    vision: Vision | None = None  # a vision-language checkpoint's vision tower and projector (16 bits in every quant)

    def parts(self) -> str:
        """The architecture's parts, as `qf plan` and the card say them."""
        layers = f"{self.config['num_hidden_layers']} layers"
        if self.vision is None:
            return f"language model ({layers})"
        tower = f"{self.vision.layers} layers, " if self.vision.layers else ""
        return (
            f"language model ({layers}), vision tower and projector ({self.vision.model_type}, {tower}"
            f"{self.vision.params / 1e6:.1f}M parameters at 16 bits: {', '.join(self.vision.parts)})"
        )


def inspect(folder: Path, architectures: Collection[str]) -> ModelInfo:
    """What the engines need to know of a checkpoint, or ModelRefused (exit 3). `architectures`: those some engine
    converts (each engine refuses the others itself: factory/engines/base.py, `refuse`)."""
    from factory.checkpoints.dequantize import refuse_unreadable  # here: it reads headers with this module's readers

    files = source_files(folder)
    if "config.json" not in files:
        refuse_unreadable(folder, None)  # a GGUF file says what it is
        raise ModelRefused(f"no config.json in {str(folder)!r}; pass a Hugging Face checkpoint folder")
    config = read_config(files["config.json"], check_numbers=False)
    if "auto_map" in config:
        raise ModelRefused(custom_code("config.json"))
    check_companions(files)
    refuse_unreadable(folder, config)  # already quantized: FP8 and MXFP4 are read (the pipeline dequantizes them)
    arches = config.get("architectures")
    arch = arches[0] if isinstance(arches, list) and arches else None
    if not isinstance(arch, str) or arch not in architectures:
        raise ModelRefused(f"architecture {arch!r} is not supported; supported: {', '.join(sorted(architectures))}")
    check_config(config)
    weights = [name for name in files if name.endswith(".safetensors")]
    if not weights:
        if any(p.suffix in PICKLE_SUFFIXES for p in folder.iterdir()):
            raise ModelRefused("the weights are only in pickle files (.bin/.pt); convert them to safetensors first")
        raise ModelRefused(f"no safetensors weights in {str(folder)!r}")
    if "tokenizer.json" not in files and "tokenizer.model" not in files:
        raise ModelRefused("no tokenizer (tokenizer.json or tokenizer.model) beside the weights")
    headers = read_headers({name: files[name] for name in weights})
    if INDEX in files:
        _check_index(files[INDEX], headers)
    tensors = {k: v for h in headers.values() for k, v in h.items()}
    check_against_tensors(config, {name: info["shape"] for name, info in tensors.items()})
    shapes = {name: info["shape"] for name, info in tensors.items()}
    in_features = _in_features(shapes)
    if not in_features:
        raise ModelRefused("no linear layers in the weights' decoder layers (model.layers.N.*, transformer.h.N.*, ...)")
    return ModelInfo(
        architecture=arch,
        model_type=str(config.get("model_type", "")),
        config=config,
        weight_files=weights,
        weight_bytes=sum(files[f].stat().st_size for f in weights),
        in_features=in_features,
        max_positions=config.get("max_position_embeddings"),
        vision=vision_of(config, shapes),
    )


INSPECTION_VERSION = 1  # raise it when ModelInfo or what `inspect` reads changes: recorded inspections are redone


def _record(source_identity: str, cache: Path) -> Path:
    return cache / "inspected" / f"{identity.inspection_key(source_identity, INSPECTION_VERSION)}.json"


def forget(source_identity: str, cache: Path) -> None:
    """Drop the inspection recorded under `source_identity`: submit took that identity from the hash cache (a
    hint), and the folder's bytes turned out not to hash to it, so the record describes other bytes."""
    _record(source_identity, cache).unlink(missing_ok=True)


def inspected(folder: Path, architectures: Collection[str], source_identity: str, cache: Path) -> ModelInfo:
    """`inspect`, once per source identity: the first inspection of a source's files (a local folder's, at submit)
    is kept in `cache`/inspected/ (identity.inspection_key) and read back for the same identity: by the job's
    estimate and its inspect step, whose snapshot of the folder hashes to that identity. Only for files that are the
    source's (never its BF16 copy, other bytes under the same identity)."""
    path = _record(source_identity, cache)
    try:
        data = json.loads(path.read_text())
        vision = data.pop("vision")
        info = ModelInfo(**data, vision=Vision(**{**vision, "parts": tuple(vision["parts"])}) if vision else None)
    except (OSError, ValueError, TypeError, KeyError):  # not recorded yet, or cut short, or of another version
        info = None
    if info is not None and info.architecture in architectures:
        return info
    info = inspect(folder, architectures)
    write_atomic(path, json.dumps(asdict(info)).encode())
    return info


def layout_info(config: dict, shapes: dict[str, list[int]]) -> ModelInfo:
    """What the engines' `refuse` reads of a checkpoint known by its config and tensor shapes only (`qf plan` of a
    folder or a Hub repo, sources.layout): no files, so no weight files or bytes."""
    arches = config.get("architectures")
    return ModelInfo(
        architecture=str(arches[0]) if isinstance(arches, list) and arches else str(arches),
        model_type=str(config.get("model_type", "")),
        config=config,
        weight_files=[],
        weight_bytes=0,
        in_features=_in_features(shapes),
        max_positions=config.get("max_position_embeddings"),
        vision=vision_of(config, shapes),
    )


def multimodal(config: dict) -> bool:
    """A vision-language checkpoint's config: a vision tower's (vision_config) beside a language model's (text_config,
    or the top level's own numbers, as the releases of Qwen2-VL and Qwen2.5-VL write them)."""
    return isinstance(config.get("vision_config"), dict)


def tower_kind(config: dict) -> str:
    """A vision-language config's vision tower kind: its vision_config's model_type, or the checkpoint's own with
    `_vision` (Qwen2.5-VL's release names none: transformers calls it qwen2_5_vl_vision)."""
    own, checkpoint = config["vision_config"].get("model_type"), config.get("model_type")
    if own:
        return own if isinstance(own, str) else "vision"
    return f"{checkpoint}_vision" if isinstance(checkpoint, str) and checkpoint else "vision"


def vision_of(config: dict, shapes: dict[str, list[int]]) -> Vision | None:
    """The vision tower and projector of a vision-language checkpoint (None for a text model), or ModelRefused when
    the vision config's numbers are not sane or the weights hold no tower."""
    if not multimodal(config):
        return None
    tower = config["vision_config"]
    for key in VISION_NUMBERS:
        value = tower.get(key)
        if value is not None and not (_positive(value) and value <= 1 << 20):
            raise ModelRefused(
                f"config.json: vision_config.{key} is {_short(value)}; it must be an integer between 1 and {1 << 20}"
            )
    parts: dict[str, int] = {}
    for name, dims in shapes.items():
        if found := VISION_PART.match(name):
            prefix = name[: found.end() - 1]
            parts[prefix] = parts.get(prefix, 0) + math.prod(dims)
    if not parts:
        raise ModelRefused(
            "config.json has a vision_config but the weights hold no vision tower (model.vision_tower, "
            "model.visual, ...)"
        )
    layers = next((tower[k] for k in ("num_hidden_layers", "depth") if tower.get(k) is not None), None)
    return Vision(
        model_type=tower_kind(config),
        parts=tuple(sorted(parts)),
        params=sum(parts.values()),
        layers=layers,
    )


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _in_features(shapes: dict[str, list[int]]) -> list[int]:
    """Input dims of the linears the engines quantize: every matrix of a decoder layer (attention, MLP, experts,
    router), whatever its family calls it; a vision tower's are not quantized."""
    return sorted(
        {dims[1] for name, dims in shapes.items() if len(dims) == 2 and name.endswith(".weight") and _LAYER.match(name)}
    )


def _check_size(path: Path, most: int, what: str, name: str | None = None) -> None:
    """ModelRefused when a metadata file (`name`: its name in the model, where `path` is a link's target) is larger
    than `what` (a model's config, ...) can be."""
    if (size := path.stat().st_size) > most:
        raise ModelRefused(f"{name or path.name} is {size} bytes; {what} is at most {most}")


def _read_at_most(path: Path, most: int, what: str) -> bytes:
    """The bytes of a metadata file, or ModelRefused when it is larger than `what` can be."""
    _check_size(path, most, what)
    return path.read_bytes()


def _json(data: bytes, what: str) -> object:
    """JSON that is UTF-8 and nested at most MAX_DEPTH levels, or ModelRefused: deeper data parses (up to the
    interpreter's recursion limit) but breaks whatever walks it later."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ModelRefused(f"{what} is not UTF-8 text") from None
    try:
        found = json.loads(text)
        too_deep = _deeper_than(found, MAX_DEPTH)
    except RecursionError:
        too_deep = True
    if too_deep:
        raise ModelRefused(f"{what} is nested too deeply to be a model's metadata")
    return found


def _deeper_than(value: object, limit: int) -> bool:
    """Whether lists and objects in `value` nest more than `limit` levels (walked without recursion)."""
    stack = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((v, depth + 1) for v in children if isinstance(v, dict | list))
    return False


def read_config(path: Path, check_numbers: bool = True) -> dict:
    """A config.json as a dict: bounded in size and depth, UTF-8, an object; with `check_numbers`, the numbers the
    factory sizes a model with are checked too (check_config)."""
    try:
        config = _json(_read_at_most(path, MAX_CONFIG, "a model's config"), "config.json")
    except ValueError as e:
        raise ModelRefused(f"config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ModelRefused("config.json is not a JSON object")
    config = with_standard_names(config)
    if check_numbers:
        check_config(config)
    return config


def with_standard_names(config: dict) -> dict:
    """The config with the sizes under their standard names too (ALIASES), the layer count where a family gives
    only its layers' kinds, intermediate_size as one number where a family says one a layer (the widest), and where
    a family leaves it implied: 4 x hidden (GPT-J's null n_inner, Falcon, Bloom), MPT's expansion_ratio x d_model.
    A vision-language config's sizes are its language model's (text_config), where the top level does not say them
    itself."""
    filled = dict(config)
    if isinstance(config.get("text_config"), dict):
        text = config["text_config"]
        text = with_standard_names({**class_defaults(text), **text})
        for name in (*CONFIG_NUMBERS, "tie_word_embeddings", "torch_dtype", "dtype"):
            if filled.get(name) is None and text.get(name) is not None:
                filled[name] = text[name]
    for name, aliases in ALIASES.items():
        if filled.get(name) is None:
            found = next((filled[a] for a in aliases if filled.get(a) is not None), None)
            if found is not None:
                filled[name] = found
    widths = filled.get("intermediate_size")  # Gemma 3n says its MLP's width once a layer: the widest sizes them all
    if isinstance(widths, list) and widths and all(isinstance(w, int) and not isinstance(w, bool) for w in widths):
        filled["intermediate_size"] = max(widths)
    kinds = filled.get("layers_block_type")  # Nemotron-H says its layers by their kinds only
    if filled.get("num_hidden_layers") is None and isinstance(kinds, list) and kinds:
        filled["num_hidden_layers"] = len(kinds)
    hidden = filled.get("hidden_size")
    if filled.get("intermediate_size") is None and isinstance(hidden, int) and not isinstance(hidden, bool):
        ratio = filled.get("expansion_ratio", 4)
        if isinstance(ratio, int) and not isinstance(ratio, bool) and 0 < ratio <= 64:
            filled["intermediate_size"] = ratio * hidden
    return filled


def class_defaults(text_config: dict) -> dict:
    """The numbers a vision-language release's text_config leaves to its transformers config class, as transformers,
    vLLM and exllamav3 fill them in: Gemma 3 4B to 27B write only the hidden size, the MLP's and the layer count, and
    leave heads (8), KV heads (4), head_dim (256) and vocabulary (262208) to Gemma3TextConfig. The class is built
    with the numbers the config does write, so what it derives from them (KV heads from heads, head_dim from hidden
    and heads) follows them. Nothing when the text_config says every number itself, or transformers cannot build
    its model_type's class."""
    model_type = text_config.get("model_type")
    given = {k: v for k in CONFIG_NUMBERS if (v := text_config.get(k)) is not None}
    if not isinstance(model_type, str) or len(given) == len(CONFIG_NUMBERS):
        return {}
    return {k: v for k, v in _defaults_of(model_type, tuple(sorted(given.items()))) if k not in given}


@functools.cache
def _defaults_of(model_type: str, given: tuple[tuple[str, object], ...]) -> tuple[tuple[str, object], ...]:
    try:
        from transformers import AutoConfig

        found = AutoConfig.for_model(model_type, **dict(given)).to_dict()
    except Exception:  # noqa: BLE001  (an unknown or odd config: no defaults, and check_config says what is missing)
        return ()
    return tuple((k, found[k]) for k in CONFIG_NUMBERS if found.get(k) is not None)


# The state-space families whose layers hold no attention (state-spaces/mamba-*, tiiuae/falcon-mamba-7b): their
# configs name no heads, and they keep no KV cache
ATTENTION_FREE = frozenset({"mamba", "falcon_mamba"})


def attention_free(config: dict) -> bool:
    return config.get("model_type") in ATTENTION_FREE and config.get("num_attention_heads") is None


def check_config(config: dict) -> dict:
    """The numbers the factory uses are integers in CONFIG_NUMBERS' ranges, heads divide the hidden size and KV
    heads divide heads (an attention-free model has none); ModelRefused with one sentence for the first that is
    not."""
    headless = attention_free(config)
    for key, (required, low, high) in CONFIG_NUMBERS.items():
        value = config.get(key)
        if value is None:
            if required and not (headless and key == "num_attention_heads"):
                raise ModelRefused(f"config.json has no {key}; the factory needs it to size the model")
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelRefused(f"config.json: {key} must be an integer, not {_short(value)}")
        if not low <= value <= high:
            raise ModelRefused(f"config.json: {key} is {value}; it must be between {low} and {high}")
    if headless:
        return config
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if hidden % heads:
        raise ModelRefused(f"config.json: hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    kv = config.get("num_key_value_heads") or heads
    if heads % kv:
        raise ModelRefused(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    return config


EMBEDDINGS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
)


def check_against_tensors(config: dict, shapes: dict[str, list[int]]) -> None:
    """The config (checked by check_config) describes these tensors: the embedding's shape and the layer count."""
    name = next((n for n in EMBEDDINGS if n in shapes), None)
    want = [config["vocab_size"], config["hidden_size"]]
    if name is not None and list(shapes[name]) != want:
        raise ModelRefused(
            f"config.json says vocab_size x hidden_size is {want[0]} x {want[1]}, but "
            f"{name} has shape {list(shapes[name])}"
        )
    layers = {int(m[1]) for key in shapes if (m := _LAYER.match(key))}
    if layers and layers != set(range(config["num_hidden_layers"])):
        raise ModelRefused(
            f"config.json says {config['num_hidden_layers']} layers (num_hidden_layers), the weights "
            f"hold {len(layers)} (numbered {min(layers)} to {max(layers)})"
        )


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_companions(files: dict[str, Path]) -> None:
    """The companions a quant carries (all but config.json, which read_config reads) are no larger than real ones
    (COMPANION_BOUNDS); the JSON ones a tool parses are UTF-8 JSON objects nested at most MAX_DEPTH levels, and
    none that transformers loads code from names custom code (auto_map). ModelRefused for the first that is not."""
    for name, (most, what) in COMPANION_BOUNDS.items():
        if name not in files:
            continue
        if name not in PARSED:
            _check_size(files[name], most, what, name)
            continue
        found = read_json(files[name], most, what, name)
        if not isinstance(found, dict):
            raise ModelRefused(f"{name} is not a JSON object")
        if "auto_map" in found and name in LOADS_CODE:
            raise ModelRefused(custom_code(name))


def custom_code(name: str) -> str:
    where = "" if name == "config.json" else f" in {name}"
    return f"the model needs custom code (auto_map{where}); only architectures built into transformers are allowed"


def read_json(path: Path, most: int, what: str, name: str | None = None) -> object:
    """A companion's JSON (`name`: its name in the model), bounded in size and depth as inspection bounds it;
    ModelRefused when it is not."""
    name = name or path.name
    _check_size(path, most, what, name)
    try:
        return _json(path.read_bytes(), name)
    except ValueError as e:
        raise ModelRefused(f"{name} is not valid JSON ({e})") from None


def read_headers(shards: dict[str, Path]) -> dict[str, dict[str, dict]]:
    """Every shard's tensor table (read_header) by shard name: at most MAX_MODEL_TENSORS tensors in all."""
    headers, listed = {}, 0
    for name, path in shards.items():
        headers[name] = read_header(path, name)
        listed += len(headers[name])
        if listed > MAX_MODEL_TENSORS:
            raise ModelRefused(
                f"the model's safetensors headers list more than {MAX_MODEL_TENSORS} tensors in all; "
                "a real model lists at most a few hundred thousand"
            )
    return headers


def read_header(path: Path, name: str | None = None) -> dict[str, dict]:
    """A safetensors file's tensor table, validated before anything is sized from it: a bounded header of JSON,
    a known dtype, a shape of at most MAX_RANK non-negative integers and integer offsets for every tensor, sizes
    that match dtype x shape, tensors that tile the data in order of their offsets (no overlap: one stored tensor
    read as many would multiply what is quantized; no gap), and a data section that ends where the last tensor does
    (truncation shows here), so no offset points past the data."""
    name = name or path.name
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelRefused(f"{name} is truncated: {size} bytes, not even a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ModelRefused(f"{name} is not a safetensors file or is truncated (header of {n} bytes)")
        if n > MAX_HEADER:
            raise ModelRefused(
                f"{name} has a header of {n} bytes; a safetensors shard's header is at most {MAX_HEADER}"
            )
        raw = f.read(n)
    # Every tensor's entry is an object, and JSON writes each with a "{" (inside names too: an overcount at most):
    # counted before parsing, the table of a header that lists too many is never built.
    if raw.count(b"{") > MAX_TENSORS + 2:  # + the header itself and __metadata__
        raise ModelRefused(
            f"{name} lists more than {MAX_TENSORS} tensors in its header; a real model's shard lists "
            "at most tens of thousands"
        )
    try:
        header = _json(raw, f"the header of {name}")
    except ValueError:
        raise ModelRefused(f"{name} has an unparsable safetensors header") from None
    if not isinstance(header, dict):
        raise ModelRefused(f"{name} has an unparsable safetensors header")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise ModelRefused(f"{name} has an unparsable __metadata__ entry (it must map names to strings)")
    data = size - 8 - n
    spans = []
    for key, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ModelRefused(f"{name} has an unparsable entry for tensor {_short(key)}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
            raise ModelRefused(f"{name}: tensor {_short(key)} has unknown dtype {_short(dtype)}")
        if not _integers(shape) or len(shape) > MAX_RANK:
            raise ModelRefused(
                f"{name}: tensor {_short(key)} has shape {_short(shape)}; a shape is a list of at most "
                f"{MAX_RANK} non-negative integers"
            )
        if not _integers(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
            raise ModelRefused(
                f"{name}: tensor {_short(key)} has data_offsets {_short(offsets)}; they must be two "
                "non-negative integers, begin <= end"
            )
        begin, stop = offsets
        expected = DTYPE_BYTES[dtype]
        for d in shape:
            expected *= d
        if stop - begin != expected:
            raise ModelRefused(f"{name}: tensor {_short(key)} has {stop - begin} bytes, its shape needs {expected}")
        spans.append((begin, stop, key))
    end = 0
    for begin, stop, key in sorted(spans):  # tensors tile the data: no two share a byte, no byte is skipped
        if begin != end:
            raise ModelRefused(
                f"{name}: tensor {_short(key)} starts at byte {begin} of the data, where {end} was expected; "
                "a safetensors file's tensors follow one another without overlap or gap"
            )
        end = stop
    if end != data:
        raise ModelRefused(f"{name} is truncated or padded: its tensors need {end} bytes of data, it holds {data}")
    return header


def _integers(value: object) -> bool:
    """A list of non-negative ints (bools are not numbers here)."""
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def _check_index(index: Path, headers: dict[str, dict]) -> None:
    try:
        weight_map = _json(_read_at_most(index, MAX_METADATA, "a safetensors index"), INDEX)["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise ModelRefused(f"{INDEX} is not a valid safetensors index") from None
    missing = sorted({f for f in weight_map.values() if f not in headers})
    if missing:
        raise ModelRefused(f"{INDEX} names shards that are not there: {', '.join(missing[:3])}")
    for tensor, shard in weight_map.items():
        if tensor not in headers[shard]:
            raise ModelRefused(f"{INDEX} puts tensor {tensor!r} in {shard}, which does not hold it")
    listed = set(weight_map.values())
    for shard, header in headers.items():
        extra = [t for t in header if weight_map.get(t) != shard]
        if shard in listed and extra:
            raise ModelRefused(f"{shard} holds tensor {extra[0]!r}, which {INDEX} does not put there")
