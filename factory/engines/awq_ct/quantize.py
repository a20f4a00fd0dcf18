"""The AWQ-CT child process: `python -m factory.engines.awq_ct.quantize request.json` (engine.py starts it; nothing
imports this module but the tests).

llm-compressor's `oneshot` with `AWQModifier` and a W4A16 asymmetric group scheme (`QuantizationModifier`), written
by `save_pretrained` in compressed-tensors' pack-quantized format. What it does beyond that, and why:
- calibration arrives as token windows of exactly the requested length and goes to oneshot as a DataLoader of them
  (batch 1, in order): no dataset loading, tokenizing, shuffling or truncation of its own;
- llm-compressor 0.14.0.1's AWQ pins its cached activations (`IntermediatesCache.pin_memory`) before each grid
  search, which raises "Cannot access accelerator device when none is available" on a machine without one; pinning
  only speeds copies to a GPU, so without an accelerator it is skipped;
- its grid search sums each candidate's squared error with `mse_loss(..., reduction="sum")` in the activations'
  dtype: in float16 at an 8B's widths (4096 x 512 tokens a window) the sum passes 65504 for every candidate, every
  loss is inf and AWQ stops with "No finite loss was found" (H100, random 8B, 2026-12-06); the losses are summed in
  float32 instead (`losses_in_float32`), as AutoAWQ computes them;
- on the CPU the model computes in float32 (float16 matmuls there are slow and lose precision) and is cast back to
  the source's dtype before saving, so the scales and the unquantized tensors are stored as the source's;
- the output head and the router of a mixture of experts (`mlp.gate`, Llama 4's `feed_forward.router`) stay
  unquantized (`ignore`), as vLLM expects;
- a mixture of experts gets AWQ mappings built from its layers (`moe_mappings`): llm-compressor's attention mappings
  for the architecture (built from the layers' kinds for a hybrid such as Qwen3-Next), and per kind of layer the
  norm before the MLP balanced against every linear that reads it (the router, the shared expert's gate where there
  is one, and the gate/up projections of the routed and shared experts in a routed layer; gate/up in a dense one).
  llm-compressor 0.14.0.1's own fail or are wrong there: DeepSeek-V3's and GLM-4-MoE's name the router for every
  layer, so a model with leading dense layers (first_k_dense_replace) stops with "AWQ needs to match a single
  smoothlayer for each mapping"; GLM-4-MoE's leave the shared expert out (it then reads the smoothed norm
  uncompensated), and Mixtral gets the dense defaults, which leave its router out;
- experts that transformers fuses on load are linearized by oneshot (one Linear per expert); they are saved under the
  source checkpoint's names (Mixtral's `w1`/`w3`/`w2`, not `gate_proj`/`up_proj`/`down_proj`) through
  llm-compressor's save conversion mappings, as vLLM reads them;
- GLM-4 and GLM-4V get mappings of their own (`glm_mappings`: their MLP fuses gate and up);
- a vision-language model is loaded whole (its processor's class) and calibrated on text alone: the vision tower
  and projector are ignored (kept at the source's precision, as vLLM expects) and the AWQ mappings are scoped to the
  language model, whose decoder layers are the ones calibrated and reported;
- one progress event per decoder layer as its calibration starts.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from factory.checkpoints.inspection import VISION_PARTS, multimodal, with_standard_names
from factory.engines import child
from factory.evaluation.evaluate import auto_model

# Left unquantized: the output head (`language_model.lm_head` in Llama 4) and a mixture of experts' router (`mlp.gate`,
# Llama 4's `feed_forward.router`), as vLLM builds them.
IGNORE = [r"re:(.*\.)?lm_head$", "re:.*mlp.gate$", r"re:.*feed_forward\.router$"]
VISION_MODULE = rf"(.*\.)?({'|'.join(VISION_PARTS)})\..*"  # a module of the vision tower or projector
VISION = f"re:{VISION_MODULE}"
# Checkpoints that name their experts' linears otherwise than the Linear modules oneshot makes of them: model_type ->
# (checkpoint name, module name) for each.
EXPERT_NAMES = {"mixtral": (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))}


def layer_count(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def decoder_layers(model):
    """The language model's decoder layers (not a vision tower's, which may be as many)."""
    import torch

    count = layer_count(model)
    return next(
        m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) == count and not re.match(VISION_MODULE, name + ".")
    )


def language_scoped(mappings: list) -> list:
    """A vision-language model's mappings, each pattern limited to its language model's modules."""
    from llmcompressor.modifiers.transform.awq import AWQMapping

    def scope(pattern: str) -> str:
        return pattern if "language_model" in pattern else rf"re:.*language_model\..*{pattern.removeprefix('re:')}"

    return [AWQMapping(scope(m.smooth_layer), [scope(b) for b in m.balance_layers]) for m in mappings]


def scoped(pattern: str, indices: list[int]) -> str:
    """An llm-compressor module pattern (`re:.*gate_proj$`) for the decoder layers `indices` only."""
    rest = pattern.removeprefix("re:").removeprefix(".*")
    return rf"re:.*layers\.({'|'.join(map(str, indices))})\.(.*\.)?{rest}"


def routed_layers(model) -> list[int]:
    """The decoder layers whose MLP has a router (`mlp.gate`): a mixture of experts'."""
    return [i for i, layer in enumerate(decoder_layers(model)) if hasattr(getattr(layer, "mlp", None), "gate")]


def moe_mappings(model) -> list:
    """The AWQ mappings of a mixture of experts (see the module's docstring): the architecture's attention
    mappings, then for routed and dense layers apart, the norm before the MLP against all that read it."""
    from llmcompressor.modifiers.transform.awq import AWQMapping
    from llmcompressor.modifiers.transform.awq.dynamic_mappings import get_layer_mappings_from_model

    base = get_layer_mappings_from_model(model)  # Qwen3-Next's are built from its layer kinds
    attention = [m for m in base if not m.smooth_layer.endswith(("post_attention_layernorm$", "up_proj$"))]
    down = [m for m in base if m.smooth_layer.endswith("up_proj$")]
    routed = routed_layers(model)
    dense = [i for i in range(len(decoder_layers(model))) if i not in routed]
    mlp = ["re:.*gate_proj$", "re:.*up_proj$"]  # the dense MLP's, or every expert's (routed and shared)
    router = ["re:.*mlp.gate$"]
    if any(name.endswith("mlp.shared_expert_gate") for name, _ in model.named_modules()):
        router.append("re:.*mlp.shared_expert_gate$")  # Qwen2-MoE's and Qwen3-Next's gate of the shared expert
    groups = [(indices, balance + mlp) for indices, balance in ((dense, []), (routed, router)) if indices]
    norms = [
        AWQMapping(scoped("re:.*post_attention_layernorm$", indices), [scoped(p, indices) for p in balance])
        for indices, balance in groups
    ]
    return [*attention, *norms, *down]


def glm_mappings() -> list:
    """GLM-4's and GLM-4V's: llm-compressor 0.14.0.1 has none and its defaults look for a gate_proj, which GLM fuses
    with up_proj (gate_up_proj). The norm before the MLP is balanced against the fused projection; down_proj reads
    act(gate) x up, which no single smoothing of gate_up_proj's output compensates, so it has no mapping."""
    from llmcompressor.modifiers.transform.awq import AWQMapping

    return [
        AWQMapping("re:.*input_layernorm$", ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]),
        AWQMapping("re:.*v_proj$", ["re:.*o_proj$"]),
        AWQMapping("re:.*post_attention_layernorm$", ["re:.*gate_up_proj$"]),
    ]


GLM = ("Glm4ForCausalLM", "Glm4vForConditionalGeneration")


def recipe(spec: dict, model, multimodal: bool) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.transform.awq.dynamic_mappings import get_layer_mappings_from_model

    mappings = moe_mappings(model) if routed_layers(model) else None  # None: llm-compressor's for the architecture
    if type(model).__name__ in GLM:
        mappings = glm_mappings()
    if multimodal:
        mappings = language_scoped(mappings or get_layer_mappings_from_model(model))
    weights = {
        "num_bits": spec["w_bit"],
        "type": "int",
        "symmetric": False,
        "strategy": "group",
        "group_size": spec["group_size"],
    }
    return [
        AWQModifier(mappings=mappings, duo_scaling=spec["duo_scaling"]),
        QuantizationModifier(
            config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
            ignore=[*IGNORE, VISION] if multimodal else IGNORE,
        ),
    ]


def skip_pinning_without_accelerator() -> None:
    import torch
    from llmcompressor.pipelines.cache import IntermediatesCache

    if not torch.accelerator.is_available():
        IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def losses_in_float32() -> None:
    from llmcompressor.modifiers.transform.awq.base import AWQModifier

    compute_loss = AWQModifier._compute_loss
    if getattr(compute_loss, "in_float32", False):
        return

    def in_float32(self, fp16_outputs, int_w_outputs):
        return compute_loss(self, [t.float() for t in fp16_outputs], [t.float() for t in int_w_outputs])

    in_float32.in_float32 = True
    AWQModifier._compute_loss = in_float32


def save_with_checkpoint_names(model, model_type: str) -> None:
    """Experts saved as the source names them (see the module's docstring)."""
    from llmcompressor.modeling.moe.conversion_mappings import (
        get_linearize_load_mappings,
        has_linearize_load_mappings,
        patch_moe_mappings,
        set_save_conversion_mapping,
    )
    from transformers.core_model_loading import WeightRenaming

    if model_type in EXPERT_NAMES:
        renames = [
            WeightRenaming(source_patterns=rf"\.experts\.(\d+)\.{saved}\.", target_patterns=rf".experts.\1.{module}.")
            for saved, module in EXPERT_NAMES[model_type]
        ]
        patch_moe_mappings(model_type, renames, remove_targets=[".experts.gate_up_proj", ".experts.down_proj"])
    if has_linearize_load_mappings(model_type):
        set_save_conversion_mapping(model, get_linearize_load_mappings(model_type)[2])


def report_layers(model, emit) -> None:
    """A progress event when calibration reaches each decoder layer (a hook on its first Linear: the sequential
    pipeline runs traced subgraphs, which call leaf modules, not the layer's own forward)."""
    import torch

    count = layer_count(model)
    reached = set()
    for index, layer in enumerate(decoder_layers(model)):
        first = next(m for m in layer.modules() if isinstance(m, torch.nn.Linear))

        def hook(module, args, index=index):
            if index not in reached:
                reached.add(index)
                emit(event="progress", done=index, total=count, unit="layer")

        first.register_forward_pre_hook(hook)


def main() -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")  # llm-compressor's grid-search bars: thousands of lines in the log
    emit = child.events()
    request = child.read_request()
    spec, calibration = request["spec"], request["calibration"]

    import torch
    from llmcompressor import oneshot
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    skip_pinning_without_accelerator()
    losses_in_float32()
    emit(event="progress", done=0, total=1, unit="load")
    config = with_standard_names(json.loads((Path(request["source_dir"]) / "config.json").read_text()))
    saved = getattr(torch, child.saved_dtype(config))
    compute = saved if torch.cuda.is_available() else torch.float32
    model = auto_model(config).from_pretrained(request["source_dir"], dtype=compute, trust_remote_code=False)
    report_layers(model, emit)
    windows = [
        {"input_ids": torch.tensor(w), "attention_mask": torch.ones(len(w), dtype=torch.long)} for w in calibration
    ]
    oneshot(
        model=model,
        processor=AutoTokenizer.from_pretrained(request["source_dir"]),  # the windows are ids: no processor reads them
        dataset=DataLoader(windows, batch_size=1),
        recipe=recipe(spec, model, multimodal(config)),
        num_calibration_samples=len(windows),
        max_seq_length=len(calibration[0]),
        trust_remote_code_model=False,
    )
    count = layer_count(model)
    emit(event="progress", done=count, total=count, unit="layer")
    save_with_checkpoint_names(model, config.get("model_type", ""))
    # a vision-language model is saved under transformers' own names: loading the names its releases use goes
    # through transformers' renaming, which casts the packed zero points to the modules' int8 (5.17: "Expected
    # torch.int32 but got torch.int8" at the first forward)
    model.to(saved).save_pretrained(request["out_dir"], save_original_format=not multimodal(config))
    if multimodal(config):
        ignore_by_pattern(Path(request["out_dir"]) / "config.json")
    child.report_peak(emit)


def ignore_by_pattern(path: Path) -> None:
    """The saved config's `ignore` as the recipe's patterns: llm-compressor writes the names of the modules it left
    out as its releases name them (Gemma 3's `language_model.lm_head`, `vision_tower.*`), which is not always what
    transformers calls the modules it loads them into (`lm_head`, `model.vision_tower.*`: a loader took those for
    quantized ones and found no weights, transformers 5.17), and where it is (Llama 4), the same patterns match."""
    config = json.loads(path.read_text())
    config["quantization_config"]["ignore"] = [*IGNORE, VISION]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
