"""An EXL3 quant of a vision-language model takes an image, as its users load it (CUDA and exllamav3 only): the
language model and the vision model from the quant's folder, the image turned into embeddings by the vision model,
one token generated for a prompt that holds them. Used by tests/gpu/test_gpu_exl3.py and benchmarks/coverage.py.
"""

from __future__ import annotations

from pathlib import Path

SIDE = 28  # pixels: the tiny checkpoints' image size (tests/support/tiny_vlms.py)


def first_token(folder: Path) -> dict:
    """The image's embedding count, the prompt's length with them and the one token generated after it."""
    from exllamav3 import ArgmaxSampler, Cache, Config, Generator, Model, Tokenizer
    from PIL import Image

    config = Config.from_directory(str(folder))
    vision = Model.from_config(config, component="vision")
    vision.load("cuda:0")
    model = Model.from_config(config)
    cache = Cache(model, max_num_tokens=1024)
    model.load("cuda:0")
    tokenizer = Tokenizer.from_config(config)
    image = Image.new("RGB", (SIDE, SIDE), (200, 30, 30))
    embedding = vision.get_image_embeddings(tokenizer=tokenizer, image=image)
    prompt = f"What is in this picture? {embedding.text_alias}\n"
    ids = tokenizer.encode(prompt, embeddings=[embedding])
    generator = Generator(model=model, cache=cache, tokenizer=tokenizer)
    text = generator.generate(
        prompt=prompt,
        max_new_tokens=1,
        embeddings=[embedding],
        sampler=ArgmaxSampler(),
        completion_only=True,
        stop_conditions=[],
    )
    return {
        "image_embeddings": embedding.mm_length,
        "prompt_tokens": int(ids.shape[-1]),
        "generated": text,
    }
