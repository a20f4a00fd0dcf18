"""A GGUF quant of a vision-language model takes an image, as its users load it: llama.cpp's llama-mtmd-cli with the
language model's file and its projector (`--mmproj`), a small generated image and a short prompt, one token
generated greedily. The tool is built when first asked for (factory/engines/gguf/llama.py: multimodal_tool, minutes
once). Used by benchmarks/coverage.py.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

from factory.engines.gguf import gguf_file, llama
from tests.support.tiny_vlms import VISION

ENCODING = re.compile(r"encoding mtmd batch, n_chunks = (\d+)")
ENCODED = re.compile(r"mtmd batch encoding done in \d+ ms")


def first_token(folder: Path) -> dict:
    """How many images the tool encoded (its log's `encoding mtmd batch, n_chunks = N`, then `... done`) and the one
    token it generated after them; ValueError with the tool's last line where it encoded none."""
    from PIL import Image

    [model, *_] = gguf_file.model_files(folder)
    mmproj = gguf_file.mmproj_file(folder)
    if mmproj is None:
        raise ValueError(f"{folder} has no mmproj-*.gguf beside the model's file")
    with tempfile.TemporaryDirectory() as tmp:
        image = Path(tmp) / "red.png"
        Image.new("RGB", (VISION["image_size"],) * 2, (200, 30, 30)).save(image)
        cmd = [str(llama.multimodal_tool()), "-m", str(model), "--mmproj", str(mmproj), "--image", str(image)]
        cmd += ["-p", "What is in this picture?", "-n", "1", "--temp", "0", "-c", "512", "--no-warmup"]
        if "tokenizer.chat_template" not in gguf_file.metadata(model):  # a tiny checkpoint may have none
            cmd += ["--chat-template", "chatml"]
        run = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=300)
    log = run.stderr + run.stdout
    encoding = ENCODING.findall(log)
    if run.returncode != 0 or not encoding or not ENCODED.search(log):
        lines = [line for line in log.splitlines() if line.strip()]
        last = ([line for line in lines if " E " in line] or lines)[-1:] or [f"exit {run.returncode}"]
        raise ValueError(f"llama-mtmd-cli encoded no image (exit {run.returncode}): {last[0][:300]}")
    return {
        "images_encoded": sum(int(n) for n in encoding),
        "generated": run.stdout.strip("\n"),
    }
