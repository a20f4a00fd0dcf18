"""Sources that are not FP16: FP8 and MXFP4 releases are dequantized to BF16 once per source, and every other
quantized format is refused in one sentence that names it (ModelRefused, exit 3).

    fp8     `quantization_config: {quant_method: fp8, weight_block_size: [m, n]}` (DeepSeek-V3, Kimi K2, Qwen3-FP8):
            each F8_E4M3 (or F8_E5M2) weight `X.weight` [..., rows, cols] has `X.weight_scale_inv` [...,
            ceil(rows/m), ceil(cols/n)], one scale a block (the last ones may be partial); weight = float32(fp8) x
            the scale of its block, rounded to BF16 (transformers' finegrained_fp8.py `Fp8Dequantize` does the same
            where the blocks are whole; it guesses the block from the scale grid, which is wrong for partial ones).
    mxfp4   `quantization_config: {quant_method: mxfp4}` (gpt-oss): experts `P_blocks` (U8 [E, R, G, 16]: 32 FP4
            E2M1 values a group, two a byte, the low nibble first) and `P_scales` (U8 [E, R, G]: 2^(byte - 127))
            become `P` = FP4_VALUES[nibble] x 2^(scale - 127) as [E, R, 32 G], transposed to [E, 32 G, R] in BF16
            (transformers' integrations/mxfp4.py, `convert_moe_packed_tensors`: what its BF16 classes hold).

The copy is what `save_pretrained` of the model class in BF16 writes, name for name and shape for shape; every
other tensor keeps its bytes (releases store them in BF16 already). config.json loses its quantization_config and
says bfloat16; the other files a source contributes (factory/checkpoints/files.py) and its model card come along as they
are. It lives in FACTORY_HOME/dequantized/<key> (key: the source identity's digest, factory/identity.py) with a marker
naming the source; `qf gc` removes a copy that no unfinished job needs (factory/publish/housekeeping.py).

Streamed: a tensor is read and written in pieces of at most CHUNK source bytes (rows of an FP8 weight, part of a
row, or many small matrices; as many whole MXFP4 experts as fit) straight into its place in the output shard, whose
header is known beforehand, so memory is one piece, never a tensor or a shard; the shapes a header claims are
bounded (MAX_MATRICES, MAX_EXPERT) before any loop over them starts, and a NaN or infinite FP8 scale is refused.
Written into `.tmp-<key>` under a lock (`.<key>.lock`: a second job of the same source waits for the first, then
reuses its copy) and renamed into place when whole: a kill leaves no entry, and the next writer of that source (or
`qf gc`) removes what it left. Tests: tests/integration/test_dequantize.py.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from factory.checkpoints import files
from factory.checkpoints.files import COMPANIONS, INDEX, source_files, upstream_card, write_atomic
from factory.checkpoints.inspection import DTYPE_BYTES, MAX_CONFIG, read_headers
from factory.errors import JobFailed, ModelRefused
from factory.identity import digest

READ = ("fp8", "mxfp4")  # the quant_methods dequantized here
# Files other tools leave beside weights they quantized, with or without a quantization_config in config.json.
MARKERS = {"quantize_config.json": "GPTQ", "quant_config.json": "AWQ", "measurement.json": "EXL2"}
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
SCALE_DTYPES = ("F32", "BF16", "F16")
FORMAT = 1  # what a copy is: a change to the output that older copies lack changes the key
MARKER = ".quantfactory-dequantized"  # written last into a copy: its source and method (never a source file)
CHUNK = 16 << 20  # source bytes read at once (an FP8 piece takes about 14 times that while it is dequantized)
# A tensor stacks at most MAX_MATRICES matrices (experts; real MoE releases stack a few hundred: gpt-oss 128, or a
# layer's experts times the layers), and an MXFP4 expert, dequantized whole, holds at most MAX_EXPERT source bytes
# (gpt-oss: 8 MiB): a header that claims more is refused before anything is read or looped over.
MAX_MATRICES = 1 << 16
MAX_EXPERT = 2 * CHUNK
Progress = Callable[..., None]


# -- what is read, what is refused ---------------------------------------------------------------------------------
def refuse_unreadable(folder: Path, config: dict | None) -> None:
    """ModelRefused, one sentence naming the format, for a checkpoint already quantized in a format the factory does
    not read: a quantization_config whose quant_method is not in READ (or an FP8 one this module cannot read), a
    GGUF file without safetensors beside it, or a file another format's tools leave (MARKERS). `config`: the parsed
    config.json, or None when the folder has none."""
    names = {p.name for p in folder.iterdir()}
    if not any(n.endswith(".safetensors") for n in names) and (gguf := sorted(n for n in names if n.endswith(".gguf"))):
        raise ModelRefused(
            f"{gguf[0]} is a GGUF file, a quantized format the factory does not read; pass the FP16 "
            "checkpoint (safetensors)"
        )
    if config is not None and "quantization_config" in config:
        method = method_of(config)
        if method is None:
            qc = config["quantization_config"]
            named = qc.get("quant_method", "unknown") if isinstance(qc, dict) else "unknown"
            raise ModelRefused(f"config.json says the model is already quantized ({named}); pass the FP16 checkpoint")
        _plan(folder, config)  # the tensors are what the config says: refused now, not when the job runs
        return
    for marker, fmt in MARKERS.items():
        if marker in names:
            raise ModelRefused(f"{marker} says the model is already quantized ({fmt}); pass the FP16 checkpoint")


def method_of(config: dict) -> str | None:
    """The quant_method of a config that this module dequantizes ('fp8', 'mxfp4'); None for any other config."""
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    return method if method in READ else None


def wanted(folder: Path) -> bool:
    """Whether the source folder's config.json says a format this module dequantizes. Lenient: a folder that is
    gone, or a config that cannot be read, is False (inspection then says what is wrong with it)."""
    try:
        path = source_files(folder).get("config.json")
        if path is None or path.stat().st_size > MAX_CONFIG:
            return False
        config = json.loads(path.read_bytes())
    except (OSError, ValueError, ModelRefused, RecursionError):
        return False
    return isinstance(config, dict) and method_of(config) is not None


def _block(qc: dict) -> tuple[int, int]:
    block = qc.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 1 << 16 for b in block)
    ):
        raise ModelRefused(
            f"config.json: fp8's weight_block_size is {json.dumps(block)}; the factory reads FP8 with "
            "one scale per block of two positive integers (e.g. [128, 128])"
        )
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ModelRefused(
            f"config.json: fp8 with {qc['activation_scheme']!r} activation scales is not read; the "
            "factory reads FP8 with dynamic activations (activation_scheme: dynamic)"
        )
    return block[0], block[1]


def bf16_shapes(config: dict, tensors: dict[str, list[int]]) -> dict[str, list[int]]:
    """The tensors (name -> shape) of the BF16 copy of a checkpoint with this config and these tensors: what `qf
    plan` and a job's estimate size the model by. Unchanged for a config that needs no dequantization."""
    method = method_of(config)
    if method == "fp8":
        return {n: s for n, s in tensors.items() if not n.endswith(".weight_scale_inv")}
    if method == "mxfp4":
        shapes = {}
        for name, shape in tensors.items():
            base = name.removesuffix("_blocks")
            if name.endswith("_blocks") and f"{base}_scales" in tensors and len(shape) == 4:
                shapes[base] = [shape[0], shape[2] * shape[3] * 2, shape[1]]
            elif not (name.endswith("_scales") and f"{name.removesuffix('_scales')}_blocks" in tensors):
                shapes[name] = shape
        return shapes
    return tensors


# -- the cache -----------------------------------------------------------------------------------------------------
def root(home: Path) -> Path:
    return home / "dequantized"


def folder(home: Path, source_identity: str) -> Path:
    """Where the BF16 copy of a source lives (whether or not it was made)."""
    return root(home) / digest(["dequantized", source_identity, FORMAT])[:32]


def made(home: Path, source_identity: str) -> Path | None:
    """The BF16 copy of a source, if it was made."""
    dest = folder(home, source_identity)
    return dest if (dest / MARKER).is_file() else None


def leftovers(home: Path, keep: set[Path]) -> list[tuple[Path, str]]:
    """What `qf gc` may remove here: copies not in `keep` (those unfinished jobs read), and what writers that were
    killed left."""
    return files.leftovers(
        root(home),
        keep,
        "BF16 copy of a source whose dequantization was killed",
        "BF16 copy of an FP8/MXFP4 source that no unfinished job needs",
    )


def bf16(source: Path, source_identity: str, home: Path, progress: Progress) -> tuple[Path, bool]:
    """The BF16 copy of an FP8 or MXFP4 source (inspected already: checkpoints/inspection.py), and whether it was
    made now (False: reused). `progress(done=, total=, unit="B")` as it is written; raising from it stops the copy,
    which then leaves nothing. ModelRefused before anything is written when its tensors are not what its config says."""
    dest = folder(home, source_identity)
    if made(home, source_identity):
        return dest, False
    dest.parent.mkdir(parents=True, exist_ok=True)
    with files.locked(
        dest.parent / f".{dest.name}.lock", progress, "the BF16 copy of this source that another job is making"
    ):
        if made(home, source_identity):  # the job that held the lock made it
            return dest, False
        tmp = dest.parent / f"{files.MAKING}{dest.name}"
        shutil.rmtree(tmp, ignore_errors=True)  # a writer that was killed: the lock is ours, so it is gone
        shutil.rmtree(dest, ignore_errors=True)  # a copy without its marker (removed by hand half-way)
        try:
            tmp.mkdir()
            _write(source, source_identity, tmp, progress)
            os.rename(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _sync(dest.parent)
    return dest, True


# -- the copy ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    """A source tensor: its name, shard, dtype, shape and where its bytes are."""

    name: str
    shard: str
    path: Path
    dtype: str
    shape: list[int]
    start: int  # absolute offset in the file
    size: int


@dataclass(frozen=True)
class _Out:
    """One tensor of the copy and how its bytes are made, piece by piece."""

    name: str
    dtype: str
    shape: list[int]
    pieces: Callable[[], Iterator[bytes | memoryview]]

    @property
    def size(self) -> int:
        return DTYPE_BYTES[self.dtype] * math.prod(self.shape)


def _plan(source: Path, config: dict) -> dict[str, list[_Out]]:
    """Each output shard's tensors (a shard of the source becomes the shard of the same name), or ModelRefused when
    the source's tensors are not what its config says (an FP8 weight without its scales, ...)."""
    method = method_of(config)
    shards = {name: path for name, path in source_files(source).items() if name.endswith(".safetensors")}
    tensors = _tensors(shards)
    by_shard: dict[str, list[str]] = {shard: [] for shard in shards}
    for name in sorted(tensors):
        by_shard[tensors[name].shard].append(name)
    if method == "fp8":
        block = _block(config["quantization_config"])
        return {shard: _fp8(tensors, names, block) for shard, names in by_shard.items()}
    return {shard: _mxfp4(tensors, names) for shard, names in by_shard.items()}


def _write(source: Path, source_identity: str, dest: Path, progress: Progress) -> None:
    files = source_files(source)
    config = json.loads(files["config.json"].read_bytes())
    plan = _plan(source, config)
    total = sum(out.size for outs in plan.values() for out in outs)
    _check_disk(dest, total)
    done, last = 0, 0.0
    for shard, outs in plan.items():
        with open(dest / shard, "wb") as f:
            f.write(_header(outs))
            for out in outs:
                written = 0
                for piece in out.pieces():
                    f.write(piece)
                    written += len(piece)
                    if time.monotonic() - last >= 1.0:
                        progress(done=done + written, total=total, unit="B")
                        last = time.monotonic()
                if written != out.size:
                    raise JobFailed(f"dequantizing {out.name} gave {written} bytes, its shape needs {out.size}")
                done += written
            f.flush()
            os.fsync(f.fileno())
        progress(done=done, total=total, unit="B")
    if INDEX in files:
        weight_map = {out.name: shard for shard, outs in plan.items() for out in outs}
        write_atomic(dest / INDEX, _json({"metadata": {"total_size": total}, "weight_map": weight_map}))
    _companions(source, files, config, dest)
    write_atomic(
        dest / MARKER, _json({"source_identity": source_identity, "quant_method": method_of(config), "format": FORMAT})
    )


def _companions(source: Path, files: dict[str, Path], config: dict, dest: Path) -> None:
    """config.json without its quantization_config, in BF16; the other companions and the model card as they are."""
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    config["dtype"] = "bfloat16"  # what transformers 5 writes; older configs say torch_dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = "bfloat16"
    write_atomic(dest / "config.json", _json(config))
    for name, path in files.items():
        if name in COMPANIONS and name != "config.json":
            shutil.copyfile(path, dest / name)
    if (card := upstream_card(source)) is not None:
        write_atomic(dest / "README.md", card.encode())


def _tensors(shards: dict[str, Path]) -> dict[str, _Tensor]:
    """Every tensor of the source by name, with where its bytes are (headers read as inspection reads them)."""
    found = {}
    for shard, header in read_headers(shards).items():
        path = shards[shard]
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
        for name, info in header.items():
            begin, end = info["data_offsets"]
            found[name] = _Tensor(name, shard, path, info["dtype"], info["shape"], 8 + n + begin, end - begin)
    return found


def _fp8(tensors: dict[str, _Tensor], names: list[str], block: tuple[int, int]) -> list[_Out]:
    """The BF16 tensors of one shard (its tensors' `names`) of an FP8 checkpoint: each FP8 weight with its scales,
    the rest as they are."""
    outs = []
    for name in names:
        t = tensors[name]
        if name.endswith(".weight_scale_inv"):
            weight = name.removesuffix("_scale_inv")
            if weight not in tensors or tensors[weight].dtype not in FP8_DTYPES:
                raise ModelRefused(f"{name} scales no FP8 weight ({weight} is not an FP8 tensor of the checkpoint)")
            continue
        if t.dtype not in FP8_DTYPES:
            outs.append(_Out(name, t.dtype, t.shape, lambda t=t: _raw(t)))
            continue
        scale = tensors.get(f"{name}_scale_inv")
        if len(t.shape) < 2:
            raise ModelRefused(f"{name} is FP8 with shape {t.shape}; the factory reads FP8 matrices")
        _check_stack(t)
        want = [*t.shape[:-2], -(-t.shape[-2] // block[0]), -(-t.shape[-1] // block[1])]
        if scale is None or scale.dtype not in SCALE_DTYPES or scale.shape != want:
            found = "none" if scale is None else f"{scale.dtype} {scale.shape}"
            raise ModelRefused(
                f"{name} is FP8 ({t.shape}) and needs {name}_scale_inv of shape {want} for blocks of "
                f"{block[0]} x {block[1]}; the checkpoint has {found}"
            )
        outs.append(_Out(name, "BF16", t.shape, lambda t=t, s=scale: _fp8_pieces(t, s, block)))
    return outs


def _mxfp4(tensors: dict[str, _Tensor], names: list[str]) -> list[_Out]:
    """The BF16 tensors of one shard (its tensors' `names`) of an MXFP4 checkpoint: each `P_blocks` with its
    `P_scales` as `P`, the rest as they are."""
    outs = []
    for name in names:
        t, base = tensors[name], name.removesuffix("_blocks")
        if name.endswith("_scales") and f"{name.removesuffix('_scales')}_blocks" in tensors:
            continue
        if not name.endswith("_blocks"):
            outs.append(_Out(name, t.dtype, t.shape, lambda t=t: _raw(t)))
            continue
        scales = tensors.get(f"{base}_scales")
        paired = scales is not None and scales.dtype == "U8" and scales.shape == t.shape[:3]
        if t.dtype != "U8" or len(t.shape) != 4 or not paired:
            found = "none" if scales is None else f"{scales.dtype} {scales.shape}"
            raise ModelRefused(
                f"{name} ({t.dtype} {t.shape}) is not MXFP4 blocks (U8 [experts, rows, groups, bytes]) "
                f"with {base}_scales (U8 [experts, rows, groups]; the checkpoint has {found})"
            )
        if base in tensors:
            raise ModelRefused(f"the checkpoint holds both {name} and {base}; the factory cannot tell which is meant")
        _check_stack(t)
        experts, rows, groups, width = t.shape
        if rows * groups * width > MAX_EXPERT:
            raise ModelRefused(
                f"{name} holds experts of {rows * groups * width} bytes each; the factory reads MXFP4 experts of "
                f"at most {MAX_EXPERT} (a real one has a few MB)"
            )
        outs.append(_Out(base, "BF16", [experts, groups * width * 2, rows], lambda t=t, s=scales: _mxfp4_pieces(t, s)))
    return outs


def _check_stack(t: _Tensor) -> None:
    if (count := math.prod(t.shape[:-2])) > MAX_MATRICES:
        raise ModelRefused(
            f"{t.name} stacks {count} matrices (experts); the factory dequantizes at most {MAX_MATRICES} a "
            "tensor (a real model stacks a few hundred)"
        )


def _read(t: _Tensor, start: int, size: int) -> bytes:
    with open(t.path, "rb") as f:
        f.seek(t.start + start)
        data = f.read(size)
    if len(data) != size:
        raise JobFailed(f"{t.path.name} ended while it was read (it changed since it was inspected)")
    return data


def _raw(t: _Tensor) -> Iterator[bytes]:
    for start in range(0, t.size, CHUNK):
        yield _read(t, start, min(CHUNK, t.size - start))


def _torch_dtype(dtype: str):
    import torch

    return {
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "F32": torch.float32,
        "BF16": torch.bfloat16,
        "F16": torch.float16,
        "U8": torch.uint8,
    }[dtype]


def _array(t: _Tensor, start: int, size: int, shape: list[int]):
    import torch

    return torch.frombuffer(bytearray(_read(t, start, size)), dtype=_torch_dtype(t.dtype)).reshape(shape)


def _bytes(tensor) -> memoryview:
    return memoryview(tensor.contiguous().reshape(-1).view(_torch_dtype("U8")).numpy())


def fp8_to_bf16(weight, scale, block: tuple[int, int]):
    """float32(weight) x the scale of its block, in BF16: weight [..., rows, cols], scale [..., ceil(rows/m),
    ceil(cols/n)] (the last blocks may be partial)."""
    import torch

    rows, cols = weight.shape[-2:]
    grid = scale.to(torch.float32).repeat_interleave(block[0], dim=-2)[..., :rows, :]
    grid = grid.repeat_interleave(block[1], dim=-1)[..., :cols]
    return (weight.to(torch.float32) * grid).to(torch.bfloat16)


def _fp8_pieces(t: _Tensor, scale: _Tensor, block: tuple[int, int]) -> Iterator[memoryview]:
    """One FP8 weight in BF16, in pieces of at most CHUNK source bytes that are contiguous in the output: whole
    matrices at once where they are small (many small experts), else runs of rows of one matrix, else (a row longer
    than CHUNK) runs of one row's columns. Each piece reads only the scales it needs, and refuses a scale that is
    NaN or infinite."""
    rows, cols = t.shape[-2:]
    matrices = math.prod(t.shape[:-2])
    if rows * cols == 0 or matrices == 0:
        return
    if rows * cols <= CHUNK:
        per = CHUNK // (rows * cols)
        scale_rows, scale_cols = scale.shape[-2:]
        for first in range(0, matrices, per):
            k = min(per, matrices - first)
            weight = _array(t, first * rows * cols, k * rows * cols, [k, rows, cols])
            size = DTYPE_BYTES[scale.dtype] * scale_rows * scale_cols
            yield _bytes(
                fp8_to_bf16(weight, _scales(scale, first * size, k * size, [k, scale_rows, scale_cols]), block)
            )
        return
    step = max(1, CHUNK // cols)  # rows a piece; one when a row is longer than CHUNK, cut into CHUNK columns then
    width = cols if cols <= CHUNK else CHUNK
    for matrix in range(matrices):
        for row in range(0, rows, step):
            for col in range(0, cols, width):
                n, w = min(step, rows - row), min(width, cols - col)
                yield _bytes(_fp8_piece(t, scale, block, matrix, (row, n), (col, w)))


def _fp8_piece(
    t: _Tensor, scale: _Tensor, block: tuple[int, int], matrix: int, at_row: tuple[int, int], at_col: tuple[int, int]
):
    """n rows from `row` of one matrix of an FP8 weight (`at_row` = (row, n)): all its columns, or w columns from
    `col` of one row (`at_col` = (col, w)), in BF16."""
    import torch

    (row, n), (col, w) = at_row, at_col
    rows, cols = t.shape[-2:]
    scale_rows, scale_cols = scale.shape[-2:]
    item = DTYPE_BYTES[scale.dtype]
    weight = _array(t, (matrix * rows + row) * cols + col, n * w, [n, w])
    first_row, first_col = row // block[0], col // block[1]
    count_rows, count_cols = (row + n - 1) // block[0] - first_row + 1, (col + w - 1) // block[1] - first_col + 1
    if w == cols:  # whole rows: their scale rows, in one read
        start = (matrix * scale_rows + first_row) * scale_cols * item
        scales = _scales(scale, start, count_rows * scale_cols * item, [count_rows, scale_cols])
    else:  # part of one row: the part of its scale row it needs
        start = ((matrix * scale_rows + first_row) * scale_cols + first_col) * item
        scales = _scales(scale, start, count_cols * item, [1, count_cols])
    down, right = row - first_row * block[0], col - first_col * block[1]  # where the piece starts in its first block
    grid = scales.to(torch.float32)
    if count_rows > 1:  # one scale row serves every row of the piece by broadcasting
        grid = grid.repeat_interleave(block[0], dim=0)[down : down + n]
    grid = grid.repeat_interleave(block[1], dim=1)[:, right : right + w]
    values = weight.to(torch.float32)
    values *= grid  # in place: a piece costs its float32 values and their grid, no third copy
    return values.to(torch.bfloat16)


def _scales(scale: _Tensor, start: int, size: int, shape: list[int]):
    """Scales of an FP8 weight, or ModelRefused when one is NaN or infinite (every weight of its block would be)."""
    import torch

    found = _array(scale, start, size, shape)
    if not bool(torch.isfinite(found).all()):
        raise ModelRefused(
            f"{scale.name} holds a NaN or infinite scale; a FP8 checkpoint's scales are finite numbers (the "
            "release is damaged)"
        )
    return found


def mxfp4_to_bf16(blocks, scales):
    """MXFP4 experts in BF16 as transformers' model classes hold them: blocks U8 [E, R, G, B] (two FP4 E2M1 values a
    byte, the low nibble first), scales U8 [E, R, G] (2^(byte - 127) a group of 2B values) -> [E, 2GB, R]."""
    import torch

    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    experts, rows, groups, width = blocks.shape
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    values = torch.ldexp(values.reshape(experts, rows, groups, 2 * width), (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.reshape(experts, rows, groups * 2 * width).transpose(1, 2).contiguous().to(torch.bfloat16)


def _mxfp4_pieces(t: _Tensor, scales: _Tensor) -> Iterator[memoryview]:
    """One MXFP4 tensor in BF16, as many whole experts at a time as fit in CHUNK source bytes (at least one: _mxfp4
    refused experts larger than MAX_EXPERT)."""
    _, rows, groups, width = t.shape
    each = rows * groups * width
    if each == 0:
        return
    per = max(1, CHUNK // each)
    for first in range(0, t.shape[0], per):
        k = min(per, t.shape[0] - first)
        blocks = _array(t, first * each, k * each, [k, rows, groups, width])
        exps = _array(scales, first * rows * groups, k * rows * groups, [k, rows, groups])
        yield _bytes(mxfp4_to_bf16(blocks, exps))


def _header(outs: list[_Out]) -> bytes:
    """A safetensors header for these tensors in this order, padded so that the data starts 8-byte aligned."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for out in outs:
        header[out.name] = {"dtype": out.dtype, "shape": out.shape, "data_offsets": [offset, offset + out.size]}
        offset += out.size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _check_disk(dest: Path, needed: int) -> None:
    free = shutil.disk_usage(dest).free
    if free < needed:
        raise JobFailed(
            f"the BF16 copy of the source needs {needed / 2**30:.1f} GiB and {dest.parent} has "
            f"{free / 2**30:.1f} GiB free; free some (qf gc) or set FACTORY_HOME elsewhere"
        )


def _json(obj: object) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def _sync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
