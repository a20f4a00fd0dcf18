"""Scoring a model layer by layer, so that memory holds one decoder layer and the windows' hidden states instead of
the whole model: a 70B-class source (140 GB in FP16) can be evaluated on one GPU the way a quantizer's measurement pass
walks a model.

The model is built on the meta device (no memory). Its embedding runs over every window with a stand-in for the
first decoder layer that records what the layer is given (hidden states, rotary embeddings, positions: the
"catcher" calibration-based quantizers use), so the model's own code prepares each layer's inputs. Then each decoder
layer in turn is read from the safetensors, run over every window's hidden states, and dropped; finally the norm and
the head turn each window's states into logits. Peak memory: the largest of the embedding, one layer and the head,
plus the states (windows x length x hidden) and one window's logits.

Only architectures whose forward is exactly embedding, uniform decoder layers, norm and head are walked this way
(ARCHITECTURES); the rest load whole (evaluate.load_fp16 decides).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
# ... and only where the config's model_type is the class's own: transformers loads EXAONE 3 (model_type exaone)
# into LlamaForCausalLM, renaming its tensors (transformer.wte, transformer.h.N) as it loads them, and the walk reads
# the files by the class's names
MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
Progress = Callable[[int, int, str], None]  # done, total, unit


def walkable(config: dict) -> bool:
    return bool(set(config.get("architectures") or []) & ARCHITECTURES) and config.get("model_type") in MODEL_TYPES


class Tensors:
    """A checkpoint's tensors by name, each read from its safetensors file when asked for."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.files: dict[str, Path] = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                self.files.update(dict.fromkeys(f.keys(), path))

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_tensor(name)


class _Caught(Exception):
    """Raised by the stand-in first layer once it has recorded its inputs."""


class ByLayer:
    """A model scored a layer at a time over all windows (see the module's docstring)."""

    def __init__(self, config, tensors: Tensors, dev: str, dtype: torch.dtype):
        self.config, self.tensors, self.dev, self.dtype = config, tensors, dev, dtype

    @classmethod
    def of(cls, folder: Path, dev: str, dtype: torch.dtype, tensors: Tensors | None = None) -> ByLayer:
        """The model in `folder` (its config.json without any quantization_config: `tensors` says what its weights
        are, e.g. dequantized ones)."""
        from transformers import AutoConfig

        config_dict = json.loads((Path(folder) / "config.json").read_text())
        config_dict.pop("quantization_config", None)
        config = AutoConfig.for_model(**config_dict)
        return cls(config, tensors or Tensors(folder), dev, dtype)

    def logits(self, windows: list[list[int]], on_progress: Progress | None = None) -> Iterator[torch.Tensor]:
        """Each window's logits [1, length, vocab], in order, computed layer by layer."""
        import torch
        from transformers import AutoModelForCausalLM

        self.config._attn_implementation = "sdpa"  # causal without a mask tensor of windows x length^2
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype, trust_remote_code=False)
        model.eval()
        base = model.model
        with torch.inference_mode():
            self._load(base.embed_tokens, "model.embed_tokens.")
            with torch.device(self.dev):  # its frequencies are computed when it is made, not read
                base.rotary_emb = type(base.rotary_emb)(config=self.config)
            states, inputs = self._first_inputs(model, windows)
            base.embed_tokens.to("meta")
            for i, layer in enumerate(base.layers):
                self._load(layer, f"model.layers.{i}.")
                for w, kwargs in enumerate(inputs):
                    out = layer(states[w], **kwargs)
                    states[w] = out[0] if isinstance(out, tuple) else out
                layer.to("meta")
                if on_progress:
                    on_progress(i + 1, len(base.layers), "layer")
            self._load(base.norm, "model.norm.")
            head = "lm_head." if "lm_head.weight" in self.tensors else "model.embed_tokens."  # tied
            self._load(model.lm_head, head)
            for w in range(len(windows)):
                yield model.lm_head(base.norm(states[w]))
                states[w] = None

    def _first_inputs(self, model, windows: list[list[int]]) -> tuple[list, list[dict]]:
        """What the first decoder layer is given for each window: its hidden states and its other arguments."""
        import torch

        caught: list[tuple] = []

        class Catcher(torch.nn.Module):
            def forward(self, hidden, **kwargs):
                caught.append((hidden, kwargs))
                raise _Caught

        layers = model.model.layers
        model.model.layers = torch.nn.ModuleList([Catcher()])
        try:
            for window in windows:
                try:
                    model(torch.tensor([window], device=self.dev), use_cache=False)
                except _Caught:
                    pass
        finally:
            model.model.layers = layers
        return [h for h, _ in caught], [kwargs for _, kwargs in caught]

    def _load(self, module, prefix: str) -> None:
        """The module's weights from the checkpoint, onto the device in the evaluation's precision."""
        module.to_empty(device=self.dev)
        state = {name: self.tensors.get(prefix + name).to(self.dev, self.dtype) for name in module.state_dict()}
        module.load_state_dict(state, strict=True)
