"""Vision-language checkpoints (issue 33): inspect reads the language model from text_config and names the vision
tower; the engines that do not convert them refuse before any job exists; `qf plan` sizes both parts; and the tiny
Gemma 3 goes through `qf run --awqct` whole: its language model quantized, its vision tower and projector kept
bit for bit, the processor's files published, and the pulled quant answering a prompt with an image in transformers
(5.17, AWQ-CT's packages) through AutoProcessor and AutoModelForImageTextToText. Every family with every engine that
claims it: tests/integration/test_coverage.py and benchmarks/results/coverage-cpu.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from factory import engines
from factory.checkpoints.inspection import inspect
from factory.engines.awq_ct import env
from factory.errors import ModelRefused
from factory.vram import human
from tests.support.tiny_vlms import FAMILIES, make_tiny_vlm

ALL = frozenset().union(*(engines.get(n).architectures for n in engines.available()))
# the vision parts each family's checkpoint holds, named as its releases name them (transformers saves them so)
PARTS = {
    "gemma3": ("multi_modal_projector", "vision_tower"),
    "mistral3": ("multi_modal_projector", "vision_tower"),
    "qwen2_5_vl": ("visual",),
    "qwen3_vl": ("model.visual",),
    "llama4": ("multi_modal_projector", "vision_model"),
    "glm4v": ("model.visual",),
    "qwen3_5": ("model.visual",),
    "qwen3_5_moe": ("model.visual",),
    "gemma4": ("model.embed_vision", "model.vision_tower"),
}


@pytest.fixture(scope="session")
def vlms(tmp_path_factory):
    """model type -> its tiny checkpoint (tests/support/tiny_vlms.py), made once a session."""
    base = tmp_path_factory.mktemp("vlms")
    return {t: make_tiny_vlm(t, base / t) for t in FAMILIES}


def _tensors(folder) -> dict[str, torch.Tensor]:
    found = {}
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            found.update({k: f.get_tensor(k) for k in f.keys()})
    return found


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_inspect_reads_the_language_model_and_names_the_vision_tower(vlms, model_type):
    info = inspect(vlms[model_type], ALL | set(FAMILIES.values()))  # Llama 4 too, which no engine takes
    assert info.architecture == FAMILIES[model_type]
    assert (info.config["hidden_size"], info.config["num_hidden_layers"]) == (128, 2)  # text_config's, not the tower's
    assert info.vision is not None and info.vision.parts == PARTS[model_type]
    assert info.vision.layers == 3 and info.vision.params > 0  # the tower has 3 layers, the language model 2
    assert 64 not in info.in_features  # the tower (64 wide) is not among what the engines quantize
    assert info.parts().startswith(f"language model (2 layers), vision tower and projector ({info.vision.model_type}")


def _copy(folder, dest):
    dest.mkdir()
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_a_vision_config_that_is_not_sane_or_a_tower_that_is_missing_is_refused(vlms, tmp_path):
    from safetensors.torch import save_file

    bad = _copy(vlms["gemma3"], tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["vision_config"]["num_hidden_layers"] = -1
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelRefused, match=r"vision_config.num_hidden_layers is -1; it must be an integer between 1"):
        inspect(bad, ALL)
    towerless = _copy(vlms["qwen2_5_vl"], tmp_path / "towerless")
    state = {k: v for k, v in _tensors(towerless).items() if not k.startswith("visual.")}
    save_file(state, towerless / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelRefused, match="has a vision_config but the weights hold no vision tower"):
        inspect(towerless, ALL)


def test_engines_that_do_not_convert_it_refuse_before_any_job(qf, vlms):
    result = qf("run", vlms["gemma3"], "--awq")  # EXL2's and EXL3's refusals: `qf plan` below (they need CUDA here)
    assert result.exit_code == 3, result.output
    assert result.output.strip().splitlines()[-1] == (
        "error: AWQ does not convert the vision-language Gemma3ForConditionalGeneration; it converts text models only"
    )
    assert qf.json("jobs") == []


def test_plan_sizes_the_language_model_and_the_vision_tower_apart(qf, vlms):
    info = inspect(vlms["qwen2_5_vl"], ALL)
    plans = qf.json("plan", vlms["qwen2_5_vl"], "--vram", "24GB")
    assert plans["awqct"]["fp16"]["vision"] == 2 * info.vision.params  # kept at 16 bits
    assert plans["awqct"]["fp16"]["weights"] < 2 * 800_000  # the language model at 4 bits (and its fp16 embeddings)
    for name, label in (("awq", "AWQ"), ("exl2", "EXL2")):
        assert plans[name] == {
            "refused": f"{label} does not convert the vision-language "
            "Qwen2_5_VLForConditionalGeneration; it converts text models only"
        }
    assert {row["vision"] for row in plans["exl3"]["rows"]} == {2 * info.vision.params}  # in EXL3's OTHER, 16 bits
    shown = qf("plan", vlms["qwen2_5_vl"], "--vram", "24GB").stdout.splitlines()
    assert f"EXL3's OTHER holds the vision tower and projector at 16 bits: {human(2 * info.vision.params)}" in shown
    assert shown[0] == info.parts() and "(qwen2_5_vl_vision, 3 layers, " in shown[0]  # the release names no kind
    [awqct] = [line for line in shown if line.startswith("AWQ-CT w4 with vLLM, fp16 KV cache (estimate): needs about ")]
    assert (
        f", vision tower and projector {human(2 * info.vision.params)} (16-bit), KV cache 2 MiB for 4096 tokens"
        in awqct
    )


# transformers as AWQ-CT's packages have it (5.17), as a user of the quant would: the processor and the model from
# the pulled folder, one generated token for a prompt with a 28-pixel image
WITH_AN_IMAGE = """
import sys, torch, transformers
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
folder = sys.argv[1]
processor = AutoProcessor.from_pretrained(folder)
model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]}]
text = processor.apply_chat_template(messages, add_generation_prompt=True)
inputs = processor(text=[text], images=[Image.new("RGB", (28, 28), (200, 30, 30))], return_tensors="pt")
assert inputs["pixel_values"].shape[-1] == 28
with torch.inference_mode():
    out = model.generate(**inputs, max_new_tokens=1, do_sample=False)
print(transformers.__version__, inputs["input_ids"].shape[1], out.shape[1])
"""


def test_gemma3_keeps_its_vision_tower_publishes_its_processor_and_the_quant_takes_an_image(qf, vlms, tmp_path):
    source = vlms["gemma3"]
    result = qf("run", source, "--awqct", "--eval-windows", 2, "--json")
    assert result.exit_code == 0, result.output
    [row] = qf.json("ls")
    assert row["name"] == "gemma3:awqct-w4g128" and row["fp16_ppl"] * 0.9 < row["ppl"] < row["fp16_ppl"] * 1.1
    assert row["kld"] is not None and row["kld"] < 0.1

    assert qf("pull", row["name"], "-o", tmp_path / "pulled").exit_code == 0
    pulled = tmp_path / "pulled"
    assert {"processor_config.json", "chat_template.jinja", "tokenizer.json"} <= {p.name for p in pulled.iterdir()}
    assert (pulled / "processor_config.json").read_bytes() == (source / "processor_config.json").read_bytes()
    fp16, quant = _tensors(source), _tensors(pulled)
    # the tower and projector bit for bit, under transformers' own names (the engine saves a vision-language quant so;
    # the release names Gemma 3's tower `vision_tower.vision_model.`, transformers `model.vision_tower.`)
    vision = [k for k in fp16 if k.startswith(PARTS["gemma3"])]
    plain = {k.removeprefix("model.").replace("vision_model.", ""): t for k, t in quant.items()}
    assert vision and all(torch.equal(plain[k.replace("vision_model.", "")], fp16[k]) for k in vision)
    assert "model.language_model.layers.0.mlp.up_proj.weight_packed" in quant  # the language model, 4-bit
    qc = json.loads((pulled / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == [
        r"re:(.*\.)?lm_head$",
        "re:.*mlp.gate$",
        r"re:.*feed_forward\.router$",
        r"re:(.*\.)?(vision_tower|visual|vision_model|multi_modal_projector|mm_projector|embed_vision)\..*",
    ]

    card = (pulled / "README.md").read_text()
    assert "pipeline_tag: image-text-to-text" in card
    assert (
        "its vision tower (`siglip_vision_model`) and the projector into its language model are kept at 16 bits" in card
    )
    assert "a system message and a user message with an image become:" in card
    assert "<start_of_turn>user\n<start_of_image>What is in this picture?<end_of_turn>" in card

    done = subprocess.run(
        [sys.executable, "-c", WITH_AN_IMAGE, str(pulled)],
        env={**os.environ, **env.child_path()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    version, prompt, generated = done.stdout.split()[-3:]
    assert version == "5.17.0" and int(generated) == int(prompt) + 1


def test_the_watchlist_plans_a_vision_language_release_for_awq_ct_and_says_why_autoawq_skips_it():
    from factory import schedule

    release = [schedule.Release("google/gemma-3-4b-it", "7" * 40, ("Gemma3ForConditionalGeneration",))]
    watches = [schedule.entry("google/gemma-3-4b-it", {"awq": {}}), schedule.entry("google/*", {"awqct": {}})]
    supported = {e.name: set(e.architectures) for e in engines.all_engines()}
    assert {p.watch: p.skipped for p in schedule.plan(watches, release, set(), supported)} == {
        "google/gemma-3-4b-it": "architecture Gemma3ForConditionalGeneration is not supported by awq",
        "google/*": None,
    }


def test_plan_of_a_vision_language_repo_on_the_hub(qf, hub, vlms):
    hub.add_repo("qwen/tiny-vl", {p.name: p.read_bytes() for p in vlms["qwen2_5_vl"].iterdir() if p.is_file()})
    plans = qf.json("plan", "qwen/tiny-vl", "--vram", "24GB")
    assert plans["awqct"]["fp16"]["vision"] == 2 * inspect(vlms["qwen2_5_vl"], ALL).vision.params


# google/gemma-3-4b-it's config.json as released: its text_config leaves heads, KV heads, head_dim and the vocabulary
# to Gemma3TextConfig's defaults, as transformers, vLLM and exllamav3 read it
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "boi_token_index": 255999,
    "eoi_token_index": 256000,
    "eos_token_id": [1, 106],
    "image_token_index": 262144,
    "mm_tokens_per_image": 256,
    "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152,
        "image_size": 896,
        "intermediate_size": 4304,
        "model_type": "siglip_vision_model",
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def test_a_release_config_that_leaves_numbers_to_its_class_is_read_as_transformers_reads_it():
    from factory.checkpoints.inspection import check_config, with_standard_names

    config = check_config(with_standard_names(GEMMA3_4B))
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                   "head_dim", "intermediate_size", "vocab_size")} == {
        "hidden_size": 2560, "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "intermediate_size": 10240, "vocab_size": 262208}  # fmt: skip


def test_qwen2_5_vl_as_released_with_the_language_models_numbers_at_the_top(vlms, tmp_path):
    """Qwen2-VL's and Qwen2.5-VL's releases write the language model's numbers at the top level, no text_config (the
    tiny checkpoint is written so: tests/support/tiny_vlms.py)."""
    source = vlms["qwen2_5_vl"]
    assert "text_config" not in json.loads((source / "config.json").read_text())
    info = inspect(source, ALL)
    assert (info.config["hidden_size"], info.config["num_hidden_layers"]) == (128, 2)
    assert info.vision is not None and info.vision.parts == ("visual",)


def test_llama_4_is_refused_before_any_job(qf, vlms):
    """llm-compressor saves Llama 4's experts one by one, which transformers does not fuse back into its experts: the
    factory could not score the quant it would publish (benchmarks/results/coverage-cpu.json says so)."""
    result = qf("run", vlms["llama4"], "--awqct")
    assert result.exit_code == 3, result.output
    assert "architecture 'Llama4ForConditionalGeneration' is not supported; supported: " in result.output
    assert qf.json("jobs") == []


def test_the_card_says_under_a_vision_language_quant_how_it_takes_an_image(vlms, tmp_path):
    """EXL3's card: under such a quant, how exllamav3's vision model turns an image into the prompt's embeddings (the
    way tests/support/exl3_image.py gives the H200's quants their image); AWQ-CT's: which transformers class loads it
    whole; neither for a text model."""
    exl3 = engines.get("exl3")
    assert exl3.card.load_note(vlms["gemma3"]).startswith("Images go through its vision model")
    assert 'Model.from_config(config, component="vision")' in exl3.card.load_note(vlms["gemma3"])
    text = tmp_path / "text"
    text.mkdir()
    (text / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 256}))
    assert exl3.card.load_note(text) is None
    assert "`AutoModelForImageTextToText`" in engines.get("awqct").card.load_note(vlms["gemma3"])
    assert "ImageTextToText" not in engines.get("awqct").card.load_note(text)
