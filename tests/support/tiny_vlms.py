"""Tiny seeded vision-language checkpoints (issue 33), made with transformers' own classes like
tests/support/tiny_archs.py: the language model shrunk as tiny_archs shrinks a text model (hidden 128, 2 layers), the
vision tower to 3 layers 128 wide (a multiple of 128 as every release's: exllamav3 pads narrower ones and GLM-4V's gated
MLP keeps the padding) over 28-pixel images in 14-pixel patches, with the tests' tokenizer and each family's image
tokens added to it.

Each is written as its family's release is, where transformers' save_pretrained writes otherwise (exllamav3 reads
the release's form, not transformers'): an image processor's preprocessor_config.json of the release's kind, the
vision config's keys as the release writes them (RELEASE_VISION), Gemma 3's tower under `vision_tower.vision_model.`.

    python -m tests.support.tiny_vlms OUT_DIR [MODEL_TYPE ...]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from tests.support.tiny_archs import BFLOAT16, HIDDEN, RELEASE, VOCAB, config_for, make_tokenizer

# model type -> the architecture its checkpoint names (the families of issue 33)
FAMILIES = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "llama4": "Llama4ForConditionalGeneration",
    "glm4v": "Glm4vForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "gemma4": "Gemma4ForConditionalGeneration",
}
# The tiny language model's rotary sections over time, height and width for heads of 32 (they sum to 16); wider
# heads (the GPU engines' 64) scale them
MROPE = {"qwen2_5_vl": [4, 6, 6], "qwen3_vl": [6, 5, 5], "glm4v": [4, 6, 6]}
# Each family's image tokens (the releases' own) -> the config key that holds its id, if any; added to the tests'
# tokenizer past its words (Gemma 3's come with its processor, gemma3_processor)
QWEN_TOKENS = {
    "<|vision_start|>": "vision_start_token_id",
    "<|vision_end|>": "vision_end_token_id",
    "<|image_pad|>": "image_token_id",
    "<|video_pad|>": "video_token_id",
}
TOKENS = {
    "mistral3": {"[IMG]": "image_token_index", "[IMG_BREAK]": None, "[IMG_END]": None},
    "qwen2_5_vl": QWEN_TOKENS,
    "qwen3_vl": QWEN_TOKENS,
    "qwen3_5": QWEN_TOKENS,
    "qwen3_5_moe": QWEN_TOKENS,
    # llama.cpp's mtmd frames a Gemma 4 image with `<|image>` and `<image|>`
    "gemma4": {"<|image>": "boi_token_id", "<|image|>": "image_token_id", "<image|>": "eoi_token_id"},
    "glm4v": {
        "<|begin_of_image|>": "image_start_token_id",
        "<|end_of_image|>": "image_end_token_id",
        "<|image|>": "image_token_id",
        "<|begin_of_video|>": "video_start_token_id",
        "<|end_of_video|>": "video_end_token_id",
        "<|video|>": "video_token_id",
    },
}
VISION = {
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "depth": 3,
    "num_attention_heads": 2,
    "num_heads": 2,
    "intermediate_size": 256,
    "out_hidden_size": HIDDEN,
    "image_size": 28,
    "patch_size": 14,
    "vision_output_dim": 128,
    "projector_input_dim": 128,
    "projector_output_dim": HIDDEN,
    # Qwen3-VL's layers that also feed the language model (the release's 8, 16 and 24 of 27): inside the tiny tower
    "deepstack_visual_indexes": [0, 1, 2],
}


# What a release's vision_config writes where transformers' save writes otherwise (Qwen/Qwen2.5-VL-7B-Instruct's
# has no model_type and says spatial_patch_size; Qwen/Qwen3-VL-8B-Instruct's names the whole model's type; Qwen3.5's
# says it has no deepstack layers, which exllamav3 reads)
RELEASE_VISION = {
    "qwen2_5_vl": {"model_type": None, "spatial_patch_size": VISION["patch_size"]},
    "qwen3_vl": {"model_type": "qwen3_vl"},
    **dict.fromkeys(("qwen3_5", "qwen3_5_moe"), {"deepstack_visual_indexes": []}),
}
# The tiny tower's numbers where a family's differ from VISION's: Gemma 4's heads as wide as the tower (its key and
# value heads named apart) and its release's 16-pixel patches, which its pooling of 3 x 3 patches is built around
RELEASE_TOWER = {
    "gemma4": {"head_dim": VISION["hidden_size"] // VISION["num_heads"], "num_key_value_heads": 2, "patch_size": 16}
}
# and what a release's config says at its top level: Gemma 4's soft tokens an image may take (its processor's
# max_soft_tokens), which exllamav3 reads
RELEASE_TOP = {"gemma4": {"vision_soft_tokens_per_image": 280}}
# The families whose releases ship their image processor inside processor_config.json (transformers 5's form: Gemma
# 4's, which exllamav3 reads there) rather than as preprocessor_config.json
PROCESSOR_CONFIG = {"gemma4"}
TEXT_AT_TOP = {"qwen2_5_vl"}  # Qwen2.5-VL's release says its language model's numbers at the top, without text_config
TIED = {"gemma4"}  # Gemma 4's releases tie the output to the embedding (llama.cpp's converter maps no lm_head for it)
# Gemma 4's language model has exactly its tokenizer's vocabulary, as the releases' (262144 both): llama.cpp's converter
# takes the tokenizer's tokens as they are, without padding them to the embedding's rows
EXACT_VOCAB = {"gemma4"}
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
QWEN_PREPROCESSOR = {
    "patch_size": VISION["patch_size"],
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": CLIP_MEAN,
    "image_std": CLIP_STD,
}
PIXELS = VISION["image_size"] ** 2
QWEN3_PREPROCESSOR = {
    **QWEN_PREPROCESSOR,
    "image_processor_type": "Qwen2VLImageProcessorFast",
    "processor_class": "Qwen3VLProcessor",
    "size": {"shortest_edge": PIXELS, "longest_edge": 4 * PIXELS},
}
# The image processor's preprocessor_config.json of each family as its release ships it, at the tiny sizes (Gemma
# 3's comes from its processor, gemma3_processor)
PREPROCESSORS = {
    "mistral3": {
        "image_processor_type": "PixtralImageProcessor",
        "processor_class": "PixtralProcessor",
        "patch_size": {"height": VISION["patch_size"], "width": VISION["patch_size"]},
        "size": {"longest_edge": VISION["image_size"]},
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
    },
    "qwen2_5_vl": {
        **QWEN_PREPROCESSOR,
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "min_pixels": PIXELS,
        "max_pixels": 4 * PIXELS,
    },
    "qwen3_vl": QWEN3_PREPROCESSOR,
    "qwen3_5": QWEN3_PREPROCESSOR,  # Qwen/Qwen3.5's processor is Qwen3-VL's
    "qwen3_5_moe": QWEN3_PREPROCESSOR,
    "gemma4": {
        "image_processor_type": "Gemma4ImageProcessor",
        "processor_class": "Gemma4Processor",
        "patch_size": 16,
        "pooling_kernel_size": 3,
        "max_soft_tokens": 280,
        "image_mean": [0.0, 0.0, 0.0],
        "image_std": [1.0, 1.0, 1.0],
        "resample": 3,
        "rescale_factor": 1 / 255,
        "do_convert_rgb": True,
        "do_normalize": False,
        "do_rescale": True,
        "do_resize": True,
    },
    "glm4v": {
        **QWEN_PREPROCESSOR,
        "image_processor_type": "Glm4vImageProcessor",
        "processor_class": "Glm4vProcessor",
        "size": {"shortest_edge": PIXELS, "longest_edge": 4 * PIXELS},
    },
}


def vlm_config(model_type: str, bos: int, eos: int, hidden: int = HIDDEN):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    tiny_text = config_for(config.text_config.model_type, bos, eos, hidden)
    tiny_text.vocab_size = VOCAB + 32  # room for the image tokens a processor adds to the tokenizer
    for key, value in tiny_text.to_diff_dict().items():
        if key not in ("model_type", "architectures", "transformers_version"):
            setattr(config.text_config, key, value)
    if model_type in MROPE:  # rotary sections over time, height and width: half the rotary dims in all
        scale = (getattr(tiny_text, "head_dim", None) or hidden // tiny_text.num_attention_heads) // 32
        sections = [n * scale for n in MROPE[model_type]]
        config.text_config.rope_parameters = {**config.text_config.rope_parameters, "mrope_section": sections}
    if config.vision_config is None:  # Gemma 4's default has no tower: its class's defaults, shrunk below
        config.vision_config = type(config).sub_configs["vision_config"]()
    for key, value in {**VISION, "out_hidden_size": hidden, "projector_output_dim": hidden}.items():
        if hasattr(config.vision_config, key):
            setattr(config.vision_config, key, value)
    for key, value in RELEASE_TOWER.get(model_type, {}).items():
        setattr(config.vision_config, key, value)
    config.bos_token_id, config.eos_token_id = bos, eos
    # the releases say it in text_config too, where exllamav3 reads it (without it the tied head was looked for as
    # lm_head, 2026-12-07 on CPU: tests/support/exl3_reads.py)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = model_type in TIED
    return config


def with_tokens(out: Path, names: dict[str, str]):
    """The tests' tokenizer in `out` with these special tokens added, each also an attribute by its name
    (tokenizer.image_token, ...), as a family's processor reads them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out, extra_special_tokens=names)
    tokenizer.add_special_tokens({"additional_special_tokens": list(names.values())})
    return tokenizer


GEMMA3_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def gemma3_processor(out: Path, tokenizer, config) -> None:
    """Gemma 3's processor: the image tokens added to the tests' tokenizer (ids past its 1024), a 28-pixel image
    processor and a chat template that writes an image as Gemma's <start_of_image>; the config names the ids."""
    from transformers import Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    names = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tokenizer = with_tokens(out, names)
    ids = tokenizer.convert_tokens_to_ids(list(names.values()))
    config.boi_token_id, config.image_token_id, config.eoi_token_id = ids
    config.mm_tokens_per_image = (VISION["image_size"] // VISION["patch_size"]) ** 2
    image = Gemma3ImageProcessorPil(size={"height": VISION["image_size"], "width": VISION["image_size"]})
    Gemma3Processor(
        image_processor=image,
        tokenizer=tokenizer,
        chat_template=GEMMA3_TEMPLATE,
        image_seq_length=config.mm_tokens_per_image,
    ).save_pretrained(out)


def load_tokenizer(out: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(out)


def add_image_tokens(out: Path, config, tokens: dict[str, str | None]) -> None:
    """The family's image tokens added to the tokenizer saved in `out`, their ids written to the config."""
    tokenizer = load_tokenizer(out)
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    tokenizer.save_pretrained(out)
    for token, key in tokens.items():
        if key is not None:
            setattr(config, key, tokenizer.convert_tokens_to_ids(token))


def as_released(model_type: str, out: Path) -> None:
    """The saved checkpoint in its release's form: the vision config's keys (RELEASE_VISION), the language model's
    numbers where the release writes them (TEXT_AT_TOP), the image processor's
    preprocessor_config.json; Gemma 3's tower under `vision_tower.vision_model.` (google/gemma-3-4b-it; transformers
    5.25 saves it as `vision_tower.` and reads both) and its image processor out of processor_config.json."""
    path = out / "config.json"
    config = json.loads(path.read_text())
    for key, value in RELEASE_VISION.get(model_type, {}).items():
        if value is None:
            config["vision_config"].pop(key, None)
        else:
            config["vision_config"][key] = value
    config.update(RELEASE_TOP.get(model_type, {}))
    text = config.get("text_config") or {}
    if text.get("model_type") in RELEASE:  # its language model's keys as that family's releases write them
        text.update(RELEASE[text["model_type"]](text))
    if model_type in TEXT_AT_TOP:
        text = config.pop("text_config")
        config |= {k: v for k, v in text.items() if k not in ("model_type", "architectures") and k not in config}
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    preprocessor = PREPROCESSORS.get(model_type)
    if model_type == "gemma3":
        from safetensors.torch import load_file, save_file

        processor = json.loads((out / "processor_config.json").read_text())
        preprocessor = {**processor.pop("image_processor"), **processor}
        (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
        weights = out / "model.safetensors"
        tensors = load_file(weights)
        tower = re.compile(r"^vision_tower\.(?!vision_model\.)")
        save_file(
            {tower.sub("vision_tower.vision_model.", k): v for k, v in tensors.items()}, weights, {"format": "pt"}
        )
    if preprocessor is not None and model_type in PROCESSOR_CONFIG:  # the image processor inside processor_config.json
        image = {k: v for k, v in preprocessor.items() if k != "processor_class"}
        processor = {"image_processor": image, "processor_class": preprocessor["processor_class"]}
        (out / "processor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    elif preprocessor is not None:
        (out / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")


# The families whose tiny checkpoints carry a processor that takes images: the others' processors need torchvision
# (transformers 5.25: Pixtral's, Qwen2-VL's video processor), which the CPU environment does not have.
PROCESSORS = {"gemma3": gemma3_processor}


def make_tiny_vlm(model_type: str, out: Path, seed: int = 0, hidden: int = HIDDEN) -> Path:
    """A tiny random vision-language checkpoint of `model_type` (FP16 weights, BF16 for BFLOAT16's; the tests'
    tokenizer; a processor where PROCESSORS has one), in `out`."""
    import torch
    from transformers import AutoModelForImageTextToText

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(model_type, out)
    config = vlm_config(model_type, tokenizer.bos_token_id, tokenizer.eos_token_id, hidden)
    if model_type in PROCESSORS:
        PROCESSORS[model_type](out, tokenizer, config)
    if model_type in TOKENS:
        add_image_tokens(out, config, TOKENS[model_type])
    if model_type in EXACT_VOCAB:
        config.text_config.vocab_size = len(load_tokenizer(out))
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).to(
        torch.bfloat16 if model_type in BFLOAT16 else torch.float16
    )
    model.save_pretrained(out)
    as_released(model_type, out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("model_types", nargs="*", default=list(FAMILIES))
    args = parser.parse_args()
    for mt in args.model_types:
        try:
            print(make_tiny_vlm(mt, args.out / mt))
        except Exception as e:  # noqa: BLE001  (a survey: say which and go on)
            print(f"{mt}: {type(e).__name__}: {e}")
