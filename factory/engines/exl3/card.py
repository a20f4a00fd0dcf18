"""EXL3's parts of the model card: how to load a quant with exllamav3 or TabbyAPI, and its KV-cache scores; its
Card part."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from factory.checkpoints.inspection import multimodal, read_config
from factory.engines.base import Card, format_scores
from factory.engines.exl3 import compat
from factory.engines.exl3.evaluate import KV_CHUNK, KV_CHUNK_NOTE

if TYPE_CHECKING:
    from factory.registry.published import QuantRow

DOTTED_NOTE = (
    "Its tensors are named `.model.…` (a leading dot), as exllamav3 1.6.5 names a text-only Gemma 3's "
    "modules, so exllamav3 1.6.5 loads it as it is; a release that fixes `Gemma3TextModel`'s key "
    "prefix may look for `model.…` instead (`factory/engines/exl3/compat.py` says why)."
)
IMAGES_NOTE = """Images go through its vision model (the tower and projector, at 16 bits in the quant):

```python
from PIL import Image
vision = Model.from_config(config, component="vision")
vision.load()
image = vision.get_image_embeddings(tokenizer=tokenizer, image=Image.open("picture.png"))
prompt = f"{image.text_alias} What is in this picture?"  # in the model's chat template
print(generator.generate(prompt=prompt, embeddings=[image], max_new_tokens=200))
```"""


def how_to_load(folder: str) -> str:
    return f"""```bash
# point TabbyAPI's model_dir at ./{folder} (TabbyAPI loads EXL3 through exllamav3)
```

```python
from exllamav3 import Cache, Config, Generator, Model, Tokenizer
config = Config.from_directory("./{folder}")
model = Model.from_config(config)
cache = Cache(model, max_num_tokens=8192)
model.load()
tokenizer = Tokenizer.from_config(config)
generator = Generator(model=model, cache=cache, tokenizer=tokenizer)
```
"""


def kv_section(rows: list[QuantRow]) -> str:
    lines = [f"- `{r.ref}`: {format_scores(r.eval['kv_cache'])}" for r in rows if r.eval.get("kv_cache")]
    if not lines:
        return ""
    return (
        "## EXL3 through a quantized KV cache\n\n"
        f"Perplexity through exllamav3's quantized cache ({KV_CHUNK_NOTE}), on the same windows:\n\n"
        + "\n".join(lines)
        + "\n"
    )


class Exl3Card(Card):
    library_name = "exllamav3"
    hub_repo = "{owner}/{model}-exl3"
    scores_about = {"kv_cache": f"exllamav3's KV cache ({KV_CHUNK}-token forwards)"}
    plot_marker = "^"

    def how_to_load(self, folder: str) -> str:
        return how_to_load(folder)

    def load_note(self, folder: Path) -> str | None:
        notes = [DOTTED_NOTE] if compat.needs_dots(folder) else []
        if multimodal(read_config(folder / "config.json", check_numbers=False)):
            notes.append(IMAGES_NOTE)
        return "\n\n".join(notes) or None

    def sections(self, rows: list[QuantRow], hub_repo: str | None = None) -> tuple[str, str]:
        return "", kv_section(rows)
