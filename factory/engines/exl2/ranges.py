"""EXL2's measurement split into ranges of decoder layers measured by several processes at once, with exllamav2
0.3.2's own functions (conversion/tokenize.py, conversion/measure.py), not a fork of them.

exllamav2 measures one module after another (`measure_quant`): for each module it runs the FP16 reference forward
over the calibration rows (which is the next module's input), then quantizes the module's linears at every
candidate setting and scores each against that reference. A module's scores need only the FP16 hidden states at
its input, never another module's scores, so the modules split into ranges:

    prepare  one child: the calibration rows' tokens and their embeddings (exllamav2's `tokenize` and `embeddings`),
             made once so that every range starts from the same states, and the ranges (module indexes)
    range    one child per range, all at once: the FP16 forward through the modules before the range (one forward
             per row and module: a small part of a module's measurement), then `measure_quant` over the range's
             modules, handed the model's modules up to the range's end (that is where it stops)
    merge    the parent: the ranges' scores, keyed by module, are one measurement, written as convert_exl2 writes
             it (`measurement`, `last_module_idx`)

A range's input states come from the same forward calls on the same inputs as in one serial measurement, so its
scores are the serial ones (tests/gpu/test_gpu_ranges.py compares them). A range killed midway starts over when the
job runs again (convert_exl2's own checkpoints resumed a serial measurement; a range is a fraction of it).

    python -m factory.engines.exl2.ranges REQUEST.json   (the child: {"stage": "prepare" | "range", ...})
"""

from __future__ import annotations

import json
import re
import sys
import threading
import types
from pathlib import Path

from factory.engines import child
from factory.errors import JobFailed

RANGES = 4  # processes at once: one measurement kept an H200's SMs 27% busy (4 passes at once: 65%)
LAYER = re.compile(r"\.(\d+)(?:\.|$)")  # model.layers.12.self_attn -> 12


def processes(layers: int) -> int:
    """How many ranges, so processes, a model of `layers` decoder layers is measured in."""
    return max(1, min(RANGES, layers))


def split(keys: list[str], most: int = RANGES) -> list[tuple[int, int]]:
    """Module keys (exllamav2's order: embedding first, the layers' modules, then norm and head) -> up to `most`
    (first, end) spans of module indexes covering modules 1..end, cut between decoder layers into runs of layers
    as equal as they can be. Modules outside the layers go with their neighbours."""
    layers = [int(m.group(1)) if (m := LAYER.search(key)) else None for key in keys]
    numbered = list(dict.fromkeys(n for n in layers if n is not None))
    count = max(1, min(most, len(numbered)))
    firsts = [numbered[len(numbered) * r // count] for r in range(1, count)]  # each later range's first layer
    starts = [1] + [layers.index(n) for n in firsts]
    return list(zip(starts, [*starts[1:], len(keys)], strict=True))


def merge(parts: list[dict], modules: int) -> dict:
    """The ranges' measurements (convert_exl2's format) -> one, as one serial measurement writes it."""
    measurement: dict = {}
    for part in parts:
        overlap = measurement.keys() & part["measurement"].keys()
        if overlap:
            raise ValueError(f"two ranges measured {sorted(overlap)[0]}")
        measurement.update(part["measurement"])
    return {"measurement": measurement, "last_module_idx": modules - 1}


def measure(
    source_dir: Path,
    calibration_file: Path,
    rows: int,
    length: int,
    work_dir: Path,
    out: Path,
    emit,
    tool,
    processes: int = RANGES,
) -> None:
    """The measurement into `out`, in up to `processes` ranges measured at once (the engine's `measure`).
    `tool(cmd, log, emit, what)` runs a child as the engine runs convert_exl2 (its environment, its status lines as
    progress)."""
    base = {"source_dir": str(source_dir), "calibration": str(calibration_file), "rows": rows, "length": length}
    shared = work_dir / "prepare"
    _child(
        tool, {**base, "stage": "prepare", "processes": processes}, shared, emit, "EXL2 measurement (its embeddings)"
    )
    spans = json.loads((shared / "ranges.json").read_text())
    done, peaks = [0.0] * len(spans["ranges"]), [0] * len(spans["ranges"])
    lock, failures = threading.Lock(), []

    def progress(r: int, event: dict) -> None:
        with lock:
            if event.get("peak_gpu_bytes") is not None:  # the unit's peak is its ranges' together
                peaks[r] = max(peaks[r], event["peak_gpu_bytes"])
            elif event.get("total"):
                done[r] = event["done"] / event["total"]
                emit({**event, "stage": "Measuring", "done": round(100 * sum(done) / len(done), 2), "total": 100})

    def one(r: int, first: int, end: int) -> None:
        request = {**base, "stage": "range", "first": first, "end": end, "states": str(shared / "states")}
        try:
            _child(tool, request, work_dir / f"range-{r}", lambda e: progress(r, e), f"EXL2 measurement range {r}")
        except BaseException as e:  # raised once the other ranges end (stopping them would stop the job's other
            with lock:  # units' engines too: child.stop_running is the process's; a range takes a minute or two)
                failures.append(e)

    threads = [
        threading.Thread(target=one, args=(r, first, end), name=f"measure range {r}")
        for r, (first, end) in enumerate(spans["ranges"])
    ]
    for thread in threads:
        thread.start()
    for thread in threads:  # each ends after its child (child.py: PDEATHSIG belongs to the starting thread)
        thread.join()
    if failures:
        raise failures[0]
    parts = []
    for r in range(len(threads)):
        try:
            parts.append(json.loads((work_dir / f"range-{r}" / "measurement.json").read_text()))
        except (OSError, ValueError) as e:
            raise JobFailed(f"EXL2 measurement range {r} wrote no measurement ({e}); see {work_dir}") from None
    out.write_text(json.dumps(merge(parts, spans["modules"]), indent=4))
    logs = [shared, *(work_dir / f"range-{r}" for r in range(len(threads)))]
    text = "".join((folder / child.LOG_NAME).read_text(errors="replace") for folder in logs)
    (work_dir.parent / f"{work_dir.name}.log").write_text(text)  # the transcript, where one serial run wrote it
    emit({"event": "progress", "peak_gpu_bytes": sum(peaks)})


def _child(tool, request: dict, folder: Path, emit, what: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "request.json"
    path.write_text(json.dumps(request))
    tool([sys.executable, "-m", __name__, str(path)], folder / child.LOG_NAME, emit, what)


# The child: exllamav2 is imported only here (importing it builds or loads its CUDA extension). It speaks as
# convert_exl2 -so does: [STATUS] lines for progress, a [PEAK_GPU_BYTES] line at the end.


def _model(source_dir: str, measuring: bool):
    """exllamav2's config and lazily loaded model, as convert_exl2 makes them (max_output_len 16 to measure)."""
    from exllamav2 import ExLlamaV2, ExLlamaV2Config

    config = ExLlamaV2Config()
    config.model_dir = source_dir
    config.prepare()
    config.arch_compat_overrides()
    if measuring:
        config.max_output_len = 16
    model = ExLlamaV2(config)
    model.load(lazy=True)
    return config, model


def _job(request: dict, work: Path, model) -> dict:
    """convert_exl2's job for a measurement: what tokenize, embeddings and measure_quant read of it."""
    from exllamav2.architecture import RopeStyle

    length = request["length"]
    if model.config.arch.lm.rope_style == RopeStyle.NONE:  # as convert_exl2 limits it
        length = min(length, model.config.max_seq_len)
    return {
        "in_dir": request["source_dir"],
        "out_dir": str(work),
        "cal_dataset": request["calibration"],
        "measurement_rows": request["rows"],
        "measurement_length": length,
        "output_measurement": None,
        "status_output": True,
    }


def _prepare(request: dict, work: Path) -> None:
    from exllamav2 import ExLlamaV2Tokenizer
    from exllamav2.conversion.measure import embeddings
    from exllamav2.conversion.tokenize import tokenize

    config, model = _model(request["source_dir"], measuring=False)
    job = _job(request, work, model)
    tokenize(job, lambda: None, ExLlamaV2Tokenizer(config), measure=True, noise_rows=config.arch.standard_calib_noise)
    embeddings(job, lambda: None, model)
    (work / "hidden_states.safetensors").rename(work / "states")
    keys = [module.key for module in model.modules]
    (work / "ranges.json").write_text(json.dumps({"modules": len(keys), "ranges": split(keys, request["processes"])}))


def _range(request: dict, work: Path) -> None:
    """The FP16 states at the range's first module (measure_quant's reference forward through the modules before
    it, without their measuring), then measure_quant over the range's modules."""
    import torch
    from exllamav2.conversion.bot_status import print_stage
    from exllamav2.conversion.measure import measure_quant
    from exllamav2.model import ExLlamaV2Attention, ExLlamaV2ParallelDecoder
    from safetensors import safe_open
    from safetensors.torch import save_file

    first, end = request["first"], request["end"]
    _, model = _model(request["source_dir"], measuring=True)
    job = {**_job(request, work, model), "last_module_idx": first - 1}
    with safe_open(request["states"], framework="pt", device="cpu") as f:
        states = [f.get_tensor(key) for key in sorted(f.keys())]
    with torch.inference_mode():
        for index in range(1, first):
            print_stage(job, "Forward", index, end)
            module = model.modules[index]
            module.load()
            attention = isinstance(module, (ExLlamaV2Attention, ExLlamaV2ParallelDecoder))
            params = ExLlamaV2Attention.Params(1, states[0].shape[1], 0, None, None) if attention else None
            states = [
                module.forward(x.to("cuda:0"), None, params, intermediates=True)["hidden_states"].cpu() for x in states
            ]
            module.unload()
    save_file({f"row.{i:05}": s.contiguous() for i, s in enumerate(states)}, str(work / "hidden_states.safetensors"))
    upto = types.SimpleNamespace(modules=model.modules[:end], config=model.config)  # where measure_quant stops
    if measure_quant(job, lambda: None, upto, 0) != "completed":
        raise RuntimeError("exllamav2's measurement was interrupted")
    print(f"{child.PEAK}{torch.cuda.max_memory_allocated()}", flush=True)


def main() -> None:
    request = json.loads(Path(sys.argv[1]).read_text())
    (_prepare if request["stage"] == "prepare" else _range)(request, Path(sys.argv[1]).parent)


if __name__ == "__main__":
    main()
