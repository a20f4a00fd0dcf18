"""What an EXL2 or EXL3 quant really occupies on a GPU (exllamav2, exllamav3), at a context length and KV-cache type
(CUDA only).

    python benchmarks/vram_fit.py measure ROOT OUT.json [SECONDS] [METHOD]   (on a CUDA machine)
    python benchmarks/vram_fit.py compare MEASURED.json... [--out benchmarks/results/vram_fit.json]

finds every EXL2 and EXL3 quant (or those of METHOD) under ROOT (registry folders of the factory), and for each
context (2k, 8k, 16k, 32k up to the model's max positions) and cache (fp16, q4, then q8) loads it in a fresh process,
fills the cache with one forward pass over the whole context (prefill of ctx-1 tokens, then one token with logits, as
a generator does; exllamav3 prefills in 2048-token chunks, as its generator does) and records: torch's peak allocated
and reserved bytes, the drop of free memory (cuda mem_get_info) from just after the CUDA context exists, and the GPU's
used memory (nvidia-smi) before the process touched CUDA and at the end, which counts what a user sees: context,
weights, cache, scratch and the allocator's reserve. Also recorded: the quant's config and tensor bytes by group, so
predictions can be checked against these numbers on any machine. Stops starting new loads after SECONDS (default 420),
so the run fits one device call.

`compare` puts the memory model's prediction (factory/engines/exl2/memory.py, exl3/memory.py) beside every
measurement: the
target is every prediction within 5% (or 64 MiB) of the drop a user sees (nvidia-smi, context included), and never
below it by more than that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from factory.engines.exl2 import memory as vram  # noqa: E402
from factory.engines.exl2.evaluate import KV_CACHES  # noqa: E402  - cache type -> exllamav2 class, as the factory scores them
from factory.engines.exl3 import memory as exl3_memory  # noqa: E402

CONTEXTS = (2048, 8192, 16384, 32768)
EXL3_CHUNK = 2048  # exllamav3's generator prefills at most this many tokens per forward (max_chunk_size)
METHODS = ("exl2", "exl3")


def _gpu_used_bytes() -> int:
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]  # the card torch sees as cuda:0
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", gpu],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return int(out.split()[0]) * 2**20


def one(folder: str, ctx: int, cache_type: str) -> dict:
    """Runs in its own process: nothing on the GPU before it starts."""
    used_before = _gpu_used_bytes()
    os.environ["EXLLAMA_NO_SDPA"] = "1"
    import exllamav2
    import torch
    from exllamav2 import ExLlamaV2, ExLlamaV2Config

    free_start, total = torch.cuda.mem_get_info()
    config = ExLlamaV2Config(folder)
    config.arch_compat_overrides()
    config.max_seq_len = ctx
    model = ExLlamaV2(config)
    model.load()
    free_loaded, _ = torch.cuda.mem_get_info()
    cache = getattr(exllamav2, KV_CACHES[cache_type])(model, max_seq_len=ctx)
    ids = torch.randint(0, config.vocab_size, (1, ctx))
    with torch.inference_mode():
        model.forward(ids[:, :-1], cache, preprocess_only=True)
        model.forward(ids[:, -1:], cache)
    return {
        "ctx": ctx,
        "cache": cache_type,
        "max_input_len": config.max_input_len,
        "max_attention_size": config.max_attention_size,
        **_memory(used_before, free_start, free_loaded, total),
    }


def one_exl3(folder: str, ctx: int, cache_type: str) -> dict:
    """As `one`, through exllamav3: its cache is made before the model loads (as its generator's users do), fp16 or
    quantized at the cache type's bits for K and V."""
    used_before = _gpu_used_bytes()
    import torch
    from exllamav3 import Cache, CacheLayer_fp16, CacheLayer_quant, Config, Model

    from factory.engines.exl3 import compat

    free_start, total = torch.cuda.mem_get_info()
    with compat.reading(Path(folder)):  # Gemma 3's tensor names, as the factory's evaluation reads them
        config = Config.from_directory(folder)
        model = Model.from_config(config)
        if cache_type == "fp16":
            cache = Cache(model, max_num_tokens=ctx, layer_type=CacheLayer_fp16)
        else:
            bits = int(cache_type.removeprefix("q"))
            cache = Cache(model, max_num_tokens=ctx, layer_type=CacheLayer_quant, k_bits=bits, v_bits=bits)
        model.load("cuda:0")
    free_loaded, _ = torch.cuda.mem_get_info()
    ids = torch.randint(0, config.vocab_size, (1, ctx))
    with torch.inference_mode():
        for start in range(0, ctx - 1, EXL3_CHUNK):
            params = {"attn_mode": "flash_attn", "cache": cache, "past_len": start, "batch_shape": (1, ctx)}
            model.prefill(ids[:, start : min(start + EXL3_CHUNK, ctx - 1)], params)
        model.forward(
            ids[:, -1:], {"attn_mode": "flash_attn", "cache": cache, "past_len": ctx - 1, "batch_shape": (1, ctx)}
        )
    return {
        "ctx": ctx,
        "cache": cache_type,
        "chunk": EXL3_CHUNK,
        **_memory(used_before, free_start, free_loaded, total),
    }


def _memory(used_before: int, free_start: int, free_loaded: int, total: int) -> dict:
    """What the load and the forward passes took, once they are done: torch's peaks, the drop of free memory, and
    the GPU's used memory as nvidia-smi counts it."""
    import torch

    torch.cuda.synchronize()
    free_end, _ = torch.cuda.mem_get_info()
    return {
        "allocated_peak": torch.cuda.max_memory_allocated(),
        "reserved_peak": torch.cuda.max_memory_reserved(),
        "free_drop_load": free_start - free_loaded,
        "free_drop": free_start - free_end,
        "gpu_used_before": used_before,
        "gpu_used_end": _gpu_used_bytes(),
        "gpu_total": total,
    }


def describe(folder: Path) -> dict:
    """The quant's shape and its tensor bytes by group (embedding, head, decoder layers, other)."""
    config = json.loads((folder / "config.json").read_text())
    return {
        "folder": folder.name,
        "config": config,
        "tensor_bytes": vram.tensor_bytes(folder),
        "file_bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors")),
    }


def quants(root: Path, methods: tuple[str, ...] = METHODS) -> list[Path]:
    found, seen = [], set()
    for cfg in sorted(root.rglob("registry/**/config.json")):
        qc = json.loads(cfg.read_text()).get("quantization_config", {})
        key = (cfg.parent.parent.name, qc.get("quant_method"), qc.get("bits"), qc.get("head_bits"))  # <name>/<tag>@
        if qc.get("quant_method") in methods and key not in seen:
            seen.add(key)
            found.append(cfg.parent)
    return found


def measure(root: Path, out: Path, budget: float, methods: tuple[str, ...] = METHODS) -> None:
    start = time.monotonic()
    results = {"gpu": None, "rows": []}
    plan = []
    for folder in quants(root, methods):
        info = describe(folder)
        max_pos = info["config"].get("max_position_embeddings", 2048)
        contexts = [c for c in CONTEXTS if c <= max_pos]
        results["rows"].append({**info, "path": str(folder.relative_to(root)), "runs": []})
        for cache in ("fp16", "q4", "q8"):
            plan += [(len(results["rows"]) - 1, folder, c, cache) for c in contexts]
    plan.sort(key=lambda p: ["fp16", "q4", "q8"].index(p[3]))  # the required pairs first, q8 if time is left
    for index, folder, ctx, cache in plan:
        if time.monotonic() - start > budget:
            print(f"time budget spent; {cache} at {ctx} for {folder.name} not measured")
            continue
        proc = subprocess.run(
            [sys.executable, __file__, "one", str(folder), str(ctx), cache], capture_output=True, text=True
        )
        if proc.returncode != 0:
            run = {"ctx": ctx, "cache": cache, "error": proc.stderr.strip().splitlines()[-1:]}
        else:
            run = json.loads(proc.stdout.strip().splitlines()[-1])
        results["rows"][index]["runs"].append(run)
        print(folder.name, json.dumps(run), flush=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
    import torch

    results["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    out.write_text(json.dumps(results, indent=1) + "\n")


def compare(measured: list[Path]) -> dict:
    rows = []
    for path in measured:
        data = json.loads(path.read_text())
        for quant in data["rows"]:
            qc = quant["config"]["quantization_config"]
            shape = vram.Shape.of(quant["config"])
            if qc["quant_method"] == "exl3":  # predicted from the shape alone, as for a quant not yet made
                weights = exl3_memory.exl3_weights(shape, exl3_memory.dense_params(shape), qc["bits"], qc["head_bits"])
            else:
                weights = vram.on_gpu(quant["tensor_bytes"])
            predict = exl3_memory.exllamav3 if qc["quant_method"] == "exl3" else vram.exllamav2
            for run in quant["runs"]:
                if "error" in run:
                    continue
                predicted = predict(shape, weights, run["ctx"], run["cache"])
                seen = run["gpu_used_end"] - run["gpu_used_before"]
                error = predicted["total"] - seen
                rows.append(
                    {
                        "model": quant["config"].get("_name_or_path") or path.stem,
                        "quant": quant["folder"],
                        "method": qc["quant_method"],
                        "ctx": run["ctx"],
                        "cache": run["cache"],
                        "measured_drop": seen,
                        "measured_torch_reserved": run["reserved_peak"],
                        "predicted": predicted["total"],
                        "predicted_parts": predicted,
                        "error_bytes": error,
                        "error": round(error / seen, 4),
                        "ok": abs(error) <= max(0.05 * seen, 64 * 2**20),
                    }
                )
    return {
        "target": "|predicted - measured| <= max(5%, 64 MiB), measured = nvidia-smi used after - before",
        "all_ok": all(r["ok"] for r in rows),
        "worst": max((abs(r["error"]) for r in rows), default=None),
        "rows": rows,
    }


def main() -> None:
    if len(sys.argv) >= 5 and sys.argv[1] == "one":
        folder = sys.argv[2]
        method = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]["quant_method"]
        print(json.dumps((one_exl3 if method == "exl3" else one)(folder, int(sys.argv[3]), sys.argv[4])))
    elif len(sys.argv) >= 3 and sys.argv[1] == "compare":
        args = sys.argv[2:]
        out = Path(args[args.index("--out") + 1]) if "--out" in args else Path("benchmarks/results/vram_fit.json")
        files = [Path(a) for a in args if a.endswith(".json") and a != str(out)]
        result = compare(files)
        out.write_text(json.dumps(result, indent=1) + "\n")
        for r in result["rows"]:
            print(
                f"{r['quant']:24} {r['ctx']:6} {r['cache']:4} measured {r['measured_drop'] / 2**20:7.0f} MiB "
                f"predicted {r['predicted'] / 2**20:7.0f} MiB  {r['error'] * 100:+.1f}%"
            )
        print(f"all within target: {result['all_ok']}, worst {result['worst'] * 100:.1f}%")
    elif len(sys.argv) >= 4 and sys.argv[1] == "measure":
        methods = (sys.argv[5],) if len(sys.argv) > 5 else METHODS
        measure(Path(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]) if len(sys.argv) > 4 else 420, methods)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
