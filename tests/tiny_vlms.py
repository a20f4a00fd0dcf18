"""Tiny seeded vision-language checkpoints (issue 33), made with transformers' own classes like tests/tiny_archs.py:
the language model shrunk as tiny_archs shrinks a text model (hidden 128, 2 layers), the vision tower to 3 layers 64
wide over 28-pixel images in 14-pixel patches, with the tests' tokenizer.

    python -m tests.tiny_vlms OUT_DIR [MODEL_TYPE ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.tiny_archs import HIDDEN, VOCAB, config_for
from tests.tiny_model import make_tiny_tokenizer

# model type -> the architecture its checkpoint names (the families of issue 33)
FAMILIES = {
    "gemma3": "Gemma3ForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "llama4": "Llama4ForConditionalGeneration",
    "glm4v": "Glm4vForConditionalGeneration",
}
# The tiny language model's rotary sections over time, height and width (heads of 32: they sum to 16)
MROPE = {"qwen2_5_vl": [4, 6, 6], "qwen3_vl": [6, 5, 5], "glm4v": [4, 6, 6]}
VISION = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "depth": 3,
    "num_attention_heads": 2,
    "num_heads": 2,
    "intermediate_size": 128,
    "out_hidden_size": HIDDEN,
    "image_size": 28,
    "patch_size": 14,
    "vision_output_dim": 64,
    "projector_input_dim": 64,
    "projector_output_dim": HIDDEN,
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
        config.text_config.rope_parameters = {**config.text_config.rope_parameters, "mrope_section": MROPE[model_type]}
    for key, value in {**VISION, "out_hidden_size": hidden, "projector_output_dim": hidden}.items():
        if hasattr(config.vision_config, key):
            setattr(config.vision_config, key, value)
    config.bos_token_id, config.eos_token_id = bos, eos
    config.tie_word_embeddings = False
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


# The families whose tiny checkpoints carry a processor that takes images: the others' processors need torchvision
# (transformers 5.25: Pixtral's, Qwen2-VL's video processor), which the CPU environment does not have.
PROCESSORS = {"gemma3": gemma3_processor}


def make_tiny_vlm(model_type: str, out: Path, seed: int = 0, hidden: int = HIDDEN) -> Path:
    """A tiny random vision-language checkpoint of `model_type` (FP16 weights, the tests' tokenizer; a processor
    where PROCESSORS has one), in `out`."""
    import torch
    from transformers import AutoModelForImageTextToText

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_tokenizer(out, VOCAB)
    config = vlm_config(model_type, tokenizer.bos_token_id, tokenizer.eos_token_id, hidden)
    if model_type in PROCESSORS:
        PROCESSORS[model_type](out, tokenizer, config)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config).to(torch.float16)
    model.save_pretrained(out)
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
