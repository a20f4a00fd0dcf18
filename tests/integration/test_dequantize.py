"""Sources that are not FP16 (factory/checkpoints/dequantize.py): FP8 and MXFP4 checkpoints written here from tiny
seeded models by the formats' own rules, dequantized to exactly what the reference formula, transformers' own
dequantization and transformers' BF16 classes say; a kill leaves no copy, a second job reuses it, `qf run --awq`
of an FP8 source publishes, and formats the factory does not read are refused in one sentence. Hostile shapes
(issue 43): pieces stay within CHUNK whatever the shape, absurd stacks of experts are refused before any loop, and a
NaN or infinite scale fails the job in one sentence."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from factory.checkpoints import dequantize, files, sources
from factory.checkpoints.inspection import inspect
from factory.errors import ModelRefused
from tests.support import ROOT
from tests.support.tiny_archs import make_tiny

FP8_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
MXFP4_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


# -- the formats, written as their releases write them ---------------------------------------------------------------
def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """F8_E4M3 weights and one float32 scale per block (the last blocks partial): amax / 448 of the block."""
    m, n = block
    rows, cols = w.shape[-2:]
    grid_rows, grid_cols = -(-rows // m), -(-cols // n)
    padded = torch.zeros(*w.shape[:-2], grid_rows * m, grid_cols * n)
    padded[..., :rows, :cols] = w.float()
    blocks = padded.reshape(*w.shape[:-2], grid_rows, m, grid_cols, n)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[..., :, None, :, None]).reshape(padded.shape)[..., :rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def fp8_formula(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight = fp8.float() x the scale of its block, block by block."""
    m, n = block
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(scale.shape[-2]):
        for j in range(scale.shape[-1]):
            part = (..., slice(i * m, (i + 1) * m), slice(j * n, (j + 1) * n))
            out[part] = q[part].float() * scale[..., i, j, None, None]
    return out.to(torch.bfloat16)


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's experts [E, in, out] as MXFP4: blocks U8 [E, out, in/32, 16] (the even value in the low nibble)
    and scales U8 [E, out, in/32] (the exponent + 127 that brings each group of 32 within FP4's +-6)."""
    x = w.float().transpose(1, 2)
    groups = x.reshape(*x.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-120) / 6)).clamp(-127, 127)
    nearest = (groups / torch.exp2(exponent)[..., None])[..., None].sub(FP4).abs().argmin(-1)
    return (nearest[..., 0::2] | nearest[..., 1::2] << 4).to(torch.uint8), (exponent + 127).to(torch.uint8)


def mxfp4_formula(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """value k of group g of row r = FP4[nibble k] x 2^(scale - 127); the BF16 class holds [E, in, out]."""
    low, high = FP4[(blocks & 15).long()], FP4[(blocks >> 4).long()]
    values = torch.stack([low, high], -1).flatten(-2) * torch.exp2(scales.float() - 127)[..., None]
    return values.flatten(-2).transpose(1, 2).to(torch.bfloat16)


def write_source(
    bf16: dict[str, torch.Tensor], quantized: dict[str, torch.Tensor], like: Path, out: Path, qc: dict, shards: int = 1
) -> Path:
    """A release folder: `like`'s companions, config.json with `qc`, the tensors in `shards` shards (with an
    index when more than one; a weight's scales in another shard than the weight itself)."""
    shutil.copytree(like, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    tensors = {**{k: v for k, v in bf16.items()}, **quantized}
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    else:
        files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        where = {name: files[i % shards] for i, name in enumerate(names)}
        for f in files:
            save_file({n: tensors[n] for n in names if where[n] == f}, out / f, metadata={"format": "pt"})
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": where}))
    config = json.loads((like / "config.json").read_text())
    config.update(dtype="bfloat16", quantization_config=qc)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def fp8_release(tiny: Path, out: Path, block=(128, 128), shards: int = 2) -> tuple[Path, dict, dict]:
    """The tiny Llama as an FP8 release: its decoder linears F8_E4M3 with weight_scale_inv, the rest BF16."""
    bf16 = {k: v.to(torch.bfloat16) for k, v in load_file(tiny / "model.safetensors").items()}
    quantized = {}
    for name in [k for k in bf16 if ".layers." in k and k.endswith("_proj.weight")]:
        quantized[name], quantized[f"{name}_scale_inv"] = quantize_fp8(bf16.pop(name), block)
    qc = {**FP8_CONFIG, "weight_block_size": list(block)}
    return write_source(bf16, quantized, tiny, out, qc, shards), bf16, quantized


def tensors_of(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for f in sorted(folder.glob("*.safetensors")):
        found.update(load_file(f))
    return found


def headers_of(folder: Path) -> dict[str, tuple[str, list[int]]]:
    found = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            found.update({k: (st.get_slice(k).get_dtype(), st.get_slice(k).get_shape()) for k in st.keys()})
    return found


@pytest.fixture(scope="module")
def fp8(tiny, tmp_path_factory):
    return fp8_release(tiny, tmp_path_factory.mktemp("fp8") / "tiny-fp8")


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """A tiny gpt-oss (transformers' own class, tests/support/tiny_archs.py) and the same model as an MXFP4 release."""
    base = tmp_path_factory.mktemp("gpt-oss")
    plain = make_tiny("gpt_oss", base / "tiny-gpt-oss")
    bf16 = {k: v.to(torch.bfloat16) for k, v in load_file(plain / "model.safetensors").items()}
    packed = {}
    for name in [k for k in bf16 if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        packed[f"{name}_blocks"], packed[f"{name}_scales"] = pack_mxfp4(bf16.pop(name))
    return plain, write_source(bf16, packed, plain, base / "tiny-gpt-oss-mxfp4", MXFP4_CONFIG), bf16, packed


def _events(progress: list):
    return lambda **event: progress.append(event)


# -- what a copy holds -----------------------------------------------------------------------------------------------
def test_fp8_as_the_formula_transformers_and_its_bf16_class_say(fp8, tmp_path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    source, bf16, quantized = fp8
    progress = []
    copy, made = dequantize.bf16(source, "sha256:fp8", tmp_path, _events(progress))
    assert made and copy == dequantize.made(tmp_path, "sha256:fp8")
    ours = tensors_of(copy)
    for name, tensor in ours.items():
        if name in quantized:
            assert tensor.dtype == torch.bfloat16
            assert torch.equal(tensor, fp8_formula(quantized[name], quantized[f"{name}_scale_inv"], (128, 128))), name
        else:
            assert torch.equal(tensor, bf16[name]), name  # the other tensors keep their bytes
    # transformers' own dequantization of the release, and the names and shapes its BF16 class saves
    model = AutoModelForCausalLM.from_pretrained(
        source, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.bfloat16
    )
    state = model.state_dict()
    assert set(state) == set(ours) and all(torch.equal(state[k], ours[k]) for k in ours)
    model.save_pretrained(tmp_path / "saved")
    assert headers_of(tmp_path / "saved") == headers_of(copy)
    # the shards keep their names, the index its shards; the companions come along; the config says BF16
    assert sorted(p.name for p in copy.glob("*.safetensors")) == sorted(p.name for p in source.glob("*.safetensors"))
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(ours) and index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in ours.values()
    )
    config = json.loads((copy / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (copy / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert progress[-1] == {
        "done": index["metadata"]["total_size"],
        "total": index["metadata"]["total_size"],
        "unit": "B",
    }
    assert AutoModelForCausalLM.from_pretrained(copy).dtype == torch.bfloat16
    assert dequantize.bf16(source, "sha256:fp8", tmp_path, _events(progress)) == (copy, False)


def test_fp8_partial_blocks_and_pieces(tiny, tmp_path, monkeypatch):
    """Dims that the blocks do not divide (the last block partial), stacked matrices, and pieces of a few block
    rows (CHUNK made small): still the formula, element for element."""
    monkeypatch.setattr(dequantize, "CHUNK", 4096)
    block = (48, 80)
    weights = {
        "model.layers.0.mlp.down_proj.weight": torch.randn(200, 300),
        "model.layers.0.mlp.experts.weight": torch.randn(3, 100, 170),
    }
    quantized = {}
    for name, w in weights.items():
        quantized[name], quantized[f"{name}_scale_inv"] = quantize_fp8(w, block)
    norm = {"model.norm.weight": torch.randn(300).to(torch.bfloat16)}
    qc = {**FP8_CONFIG, "weight_block_size": list(block)}
    source = write_source(norm, quantized, tiny, tmp_path / "odd", qc)
    copy, _ = dequantize.bf16(source, "sha256:odd", tmp_path / "home", lambda **_: None)
    ours = tensors_of(copy)
    for name in weights:
        assert torch.equal(ours[name], fp8_formula(quantized[name], quantized[f"{name}_scale_inv"], block)), name
    assert torch.equal(ours["model.norm.weight"], norm["model.norm.weight"])
    assert set(ours) == {*weights, *norm}


def test_mxfp4_as_the_formula_transformers_and_its_bf16_class_say(gpt_oss, tmp_path):
    from transformers import AutoModelForCausalLM, Mxfp4Config
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    plain, source, bf16, packed = gpt_oss
    copy, made = dequantize.bf16(source, "sha256:mxfp4", tmp_path, lambda **_: None)
    ours = tensors_of(copy)
    for name in [k.removesuffix("_blocks") for k in packed if k.endswith("_blocks")]:
        blocks, scales = packed[f"{name}_blocks"], packed[f"{name}_scales"]
        assert torch.equal(ours[name], mxfp4_formula(blocks, scales)), name
        assert torch.equal(ours[name], convert_moe_packed_tensors(blocks, scales)), name
    assert all(torch.equal(ours[k], v) for k, v in bf16.items())
    # the names and shapes transformers' BF16 class saves (the plain tiny gpt-oss), and its own dequantization
    assert {k: s for k, (_, s) in headers_of(copy).items()} == {k: s for k, (_, s) in headers_of(plain).items()}
    model = AutoModelForCausalLM.from_pretrained(
        source, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16
    )
    state = model.state_dict()
    assert set(state) == set(ours) and all(torch.equal(state[k], ours[k]) for k in ours)
    # qf plan and a job's estimate size the model by its BF16 copy's shapes
    assert sources.layout(str(source))[1] == sources.layout(str(copy))[1] == sources.layout(str(plain))[1]


# -- the cache -------------------------------------------------------------------------------------------------------
KILLED = """
import sys, time
from pathlib import Path
from factory.checkpoints import dequantize

def stop(**event):
    print("writing", flush=True)
    time.sleep(600)

dequantize.bf16(Path(sys.argv[1]), "sha256:killed", Path(sys.argv[2]), stop)
"""


def test_a_kill_leaves_no_copy(qf, fp8):
    source, _, _ = fp8
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED, str(source), str(qf.home)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline() == "writing\n"  # its first piece is written
        waited = []  # a second job of the source meanwhile waits for that copy, saying so, until it is stopped

        def stop(**event):
            waited.append(event)
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            dequantize.bf16(source, "sha256:killed", qf.home, stop)
        assert waited == [{"waiting_for": "the BF16 copy of this source that another job is making"}]
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    root = dequantize.root(qf.home)
    [tmp] = [p for p in root.iterdir() if p.name.startswith(files.MAKING)]
    assert dequantize.made(qf.home, "sha256:killed") is None
    assert not dequantize.folder(qf.home, "sha256:killed").exists()
    planned = qf.json("gc", "--dry-run")
    assert [(i["path"], i["why"]) for i in planned["items"]] == [
        (str(tmp), "BF16 copy of a source whose dequantization was killed")
    ]
    copy, made = dequantize.bf16(source, "sha256:killed", qf.home, lambda **_: None)  # takes over what it left
    assert (
        made
        and not tmp.exists()
        and sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == [copy.name]
    )

    def interrupt(**event):  # Ctrl-C (or a cancel) while a copy is written: nothing is left of it
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        dequantize.bf16(source, "sha256:interrupted", qf.home, interrupt)
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == [copy.name]


def test_run_awq_of_an_fp8_source_publishes_and_a_second_job_reuses_its_copy(qf, fp8, tmp_path):
    source, _, _ = fp8
    result = qf("run", source, "--awq", "--eval-windows", 2, "--json")
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    job = events[0]["job"]
    steps = [(e["step"], e["state"]) for e in events if e["event"] == "step"]
    assert steps[:4] == [
        ("dequantize", "running"),
        ("dequantize", "succeeded"),
        ("inspect", "running"),
        ("inspect", "succeeded"),
    ]
    assert any(e["event"] == "progress" and e["step"] == "dequantize" and e["unit"] == "B" for e in events)
    [row] = qf.json("ls")
    assert row["name"] == "tiny-fp8:awq-w4g128" and row["ppl"] < 1.5 * row["fp16_ppl"]
    pulled = tmp_path / "pulled"
    assert qf("pull", row["name"], "-o", pulled).exit_code == 0
    assert json.loads((pulled / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    [copy] = [p for p in dequantize.root(qf.home).iterdir() if not p.name.startswith(".")]
    stamp = copy.stat().st_mtime_ns

    again = qf("run", source, "--awq", "--eval-windows", 1, "--json")  # another job: the same source, quant reused
    assert again.exit_code == 0, again.output
    events = [json.loads(line) for line in again.stdout.splitlines()]
    assert events[0]["job"] != job and events[0]["created"]
    assert any(
        e["event"] == "note"
        and e["message"].startswith("dequantize: the BF16 copy of this source made earlier is reused")
        for e in events
    )
    assert copy.stat().st_mtime_ns == stamp and not any(
        e["event"] == "progress" and e["step"] == "dequantize" for e in events
    )
    planned = qf.json("gc", "--dry-run")  # both jobs succeeded: nothing unfinished needs the copy any more
    assert (str(copy), "BF16 copy of an FP8/MXFP4 source that no unfinished job needs") in {
        (i["path"], i["why"]) for i in planned["items"]
    }


# -- what is refused -------------------------------------------------------------------------------------------------
def _config(qc):
    def change(m: Path):
        config = json.loads((m / "config.json").read_text())
        config["quantization_config"] = qc
        (m / "config.json").write_text(json.dumps(config))

    return change


def _file(name: str, keep_weights: bool = True):
    def change(m: Path):
        (m / name).write_text("{}")
        if not keep_weights:
            (m / "model.safetensors").unlink()
            (m / "config.json").unlink()

    return change


def _fp8_without_scales(m: Path):
    tensors = load_file(m / "model.safetensors")
    name = "model.layers.0.mlp.gate_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, m / "model.safetensors", metadata={"format": "pt"})
    _config(FP8_CONFIG)(m)


def _sparse_shard(config: dict, tensors: dict[str, tuple[str, list[int]]]):
    """config.json's quantization_config set to `config`, and a shard whose header lists `tensors` (name -> dtype,
    shape) with their data as a hole: a header's claim, costing no disk."""

    def change(m: Path):
        _config(config)(m)
        header, offset = {}, 0
        for name, (dtype, shape) in tensors.items():
            size = {"F8_E4M3": 1, "U8": 1, "F32": 4}[dtype] * math.prod(shape)
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header).encode()
        with open(m / "experts.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + offset)

    return change


EXPERTS = "model.layers.0.mlp.experts.weight"
BLOCKS = "model.layers.0.mlp.experts.gate_up_proj_blocks"
REFUSED = [
    (
        "awq",
        _config({"quant_method": "awq", "bits": 4}),
        "config.json says the model is already quantized (awq); pass the FP16 checkpoint",
    ),
    (
        "gptq",
        _config({"quant_method": "gptq", "bits": 4}),
        "config.json says the model is already quantized (gptq); pass the FP16 checkpoint",
    ),
    (
        "exl2",
        _config({"quant_method": "exl2", "bits": 4.0}),
        "config.json says the model is already quantized (exl2); pass the FP16 checkpoint",
    ),
    (
        "bitsandbytes",
        _config({"quant_method": "bitsandbytes", "load_in_4bit": True}),
        "config.json says the model is already quantized (bitsandbytes); pass the FP16 checkpoint",
    ),
    (
        "compressed-tensors",
        _config({"quant_method": "compressed-tensors"}),
        "config.json says the model is already quantized (compressed-tensors); pass the FP16 checkpoint",
    ),
    (
        "not-an-object",
        _config("fp8"),
        "config.json says the model is already quantized (unknown); pass the FP16 checkpoint",
    ),
    (
        "exl2-files",
        _file("measurement.json"),
        "measurement.json says the model is already quantized (EXL2); pass the FP16 checkpoint",
    ),
    (
        "gptq-files",
        _file("quantize_config.json"),
        "quantize_config.json says the model is already quantized (GPTQ); pass the FP16 checkpoint",
    ),
    (
        "awq-files",
        _file("quant_config.json"),
        "quant_config.json says the model is already quantized (AWQ); pass the FP16 checkpoint",
    ),
    (
        "gguf",
        _file("tiny.Q4_K_M.gguf", keep_weights=False),
        "tiny.Q4_K_M.gguf is a GGUF file, a quantized format the factory does not read; pass the FP16 checkpoint "
        "(safetensors)",
    ),
    (
        "fp8-per-tensor",
        _config({**FP8_CONFIG, "weight_block_size": None}),
        "config.json: fp8's weight_block_size is null; the factory reads FP8 with one scale per block of two positive "
        "integers (e.g. [128, 128])",
    ),
    (
        "fp8-static",
        _config({**FP8_CONFIG, "activation_scheme": "static"}),
        "config.json: fp8 with 'static' activation scales is not read; the factory reads FP8 with dynamic activations "
        "(activation_scheme: dynamic)",
    ),
    (
        "fp8-without-scales",
        _fp8_without_scales,
        "model.layers.0.mlp.gate_proj.weight is FP8 ([256, 128]) and needs "
        "model.layers.0.mlp.gate_proj.weight_scale_inv of shape [2, 1] for blocks of 128 x 128; "
        "the checkpoint has none",
    ),
    (  # the 2M one-row experts took 162 s of CPU, one expert a loop
        "fp8-2M-experts",
        _sparse_shard(
            FP8_CONFIG, {EXPERTS: ("F8_E4M3", [2_000_000, 1, 128]), f"{EXPERTS}_scale_inv": ("F32", [2_000_000, 1, 1])}
        ),
        f"{EXPERTS} stacks 2000000 matrices (experts); the factory dequantizes at most 65536 a tensor (a real model "
        "stacks a few hundred)",
    ),
    (
        "mxfp4-expert-of-64-MiB",
        _sparse_shard(
            {"quant_method": "mxfp4"},
            {BLOCKS: ("U8", [1, 65536, 64, 16]), BLOCKS.replace("_blocks", "_scales"): ("U8", [1, 65536, 64])},
        ),
        f"{BLOCKS} holds experts of 67108864 bytes each; the factory reads MXFP4 experts of at most 33554432 (a real "
        "one has a few MB)",
    ),
]


@pytest.mark.parametrize(("breaks", "message"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED])
def test_formats_not_read_are_refused_in_one_sentence(model_copy, breaks, message):
    model = model_copy()
    breaks(model)
    with pytest.raises(ModelRefused) as refused:
        inspect(model, ["LlamaForCausalLM"])
    assert refused.value.message == message and refused.value.exit_code == 3


@pytest.mark.parametrize("case", ["gptq", "gguf", "fp8-2M-experts"])
def test_qf_run_refuses_them_before_any_job(qf, model_copy, case):
    [(_, breaks, message)] = [c for c in REFUSED if c[0] == case]
    model = model_copy()
    breaks(model)
    result = qf("run", model, "--awq")
    assert result.exit_code == 3, result.output
    assert result.stderr.splitlines()[-1] == f"error: {message}"
    assert "Traceback" not in result.output and qf.json("jobs") == []


# -- hostile shapes and scales (issue 43) ----------------------------------------------------------------------------
def test_every_piece_stays_within_chunk_whatever_the_shape(tiny, tmp_path, monkeypatch):
    """The issue's FP8 tensor of 256 MiB (one long row, a sparse file) took 3.65 GB to dequantize: a piece was a
    block row (128 rows), however long a row was. With CHUNK at 4 KiB: a row of 20,000 columns, and 5,000 one-row
    experts; every piece the copy writes holds at most CHUNK source bytes (2 x CHUNK of BF16), and the copy is
    still the formula."""
    monkeypatch.setattr(dequantize, "CHUNK", 4096)
    pieces = []
    whole = dequantize._bytes
    monkeypatch.setattr(dequantize, "_bytes", lambda tensor: pieces.append(tensor.numel()) or whole(tensor))
    block = (128, 128)
    weights = {"model.layers.0.mlp.down_proj.weight": torch.randn(2, 20_000), EXPERTS: torch.randn(5000, 1, 64)}
    quantized = {}
    for name, w in weights.items():
        quantized[name], quantized[f"{name}_scale_inv"] = quantize_fp8(w, block)
    source = write_source({}, quantized, tiny, tmp_path / "long", {**FP8_CONFIG, "weight_block_size": list(block)})
    copy, _ = dequantize.bf16(source, "sha256:long", tmp_path / "home", lambda **_: None)
    ours = tensors_of(copy)
    for name in weights:
        assert torch.equal(ours[name], fp8_formula(quantized[name], quantized[f"{name}_scale_inv"], block)), name
    assert max(pieces) <= 4096 and sum(pieces) == sum(w.numel() for w in weights.values())
    assert len(pieces) == 2 * 5 + math.ceil(5000 / 64)  # each row in 5 pieces; 64 experts a piece, not one each


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_a_scale_that_is_not_a_number_fails_the_job_in_one_sentence(qf, tiny, tmp_path, bad):
    source, _, quantized = fp8_release(tiny, tmp_path / "damaged", shards=1)
    name = "model.layers.1.mlp.up_proj.weight_scale_inv"
    tensors = load_file(source / "model.safetensors")
    tensors[name][0, 0] = bad
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    result = subprocess.run(
        [sys.executable, "-m", "factory.cli", "run", str(source), "--awq", "--eval-windows", "1"],
        env={**os.environ, **qf.env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: {name} holds a NaN or infinite scale; a FP8 checkpoint's scales are finite numbers (the release is "
        "damaged)"
    )
    assert qf.json("ls") == [] and dequantize.root(qf.home).is_dir()
    assert [p for p in dequantize.root(qf.home).iterdir() if not p.name.startswith(".")] == []
