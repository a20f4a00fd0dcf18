"""Expected seconds of units and jobs (factory/jobs/eta.py): families of step names, history in a size bucket
scaled by parameters, the first-principles fallback, and a job's wall time under packing."""

from __future__ import annotations

from factory.jobs import eta
from factory.jobs.eta import Past
from factory.jobs.graph import Unit
from factory.jobs.packing import Need, Packer


def test_families_of_step_names():
    assert eta.family("quantize:exl2-4.0bpw") == "quantize:exl2"
    assert eta.family("quantize:awq-w4g128") == "quantize:awq"
    assert eta.family("evaluate:exl2-4.0bpw:kv") == "evaluate:exl2:kv"
    assert eta.family("evaluate:exl3-4.0bpw") == "evaluate:exl3"
    assert eta.family("evaluate:fp16") == "evaluate:fp16"
    assert eta.family("measure:1a2b3c4d5e6f") == "measure"
    assert [eta.family(f"{s}:1a2b3c4d5e6f") for s in ("convert", "imatrix")] == ["convert", "imatrix"]  # GGUF's
    assert eta.family("publish:awq-w4g128") == "publish"
    assert eta.family("gate") == "gate"


def test_history_in_the_size_bucket_scaled_by_parameters_else_the_estimate():
    past = [Past(100.0, 1_000_000_000), Past(120.0, 1_200_000_000), Past(30.0, 135_000_000)]
    seconds, basis = eta.expected(past, 1_100_000_000, first_principles=999.0)
    assert basis == "history (2 units)" and abs(seconds - 110.0) < 1e-9  # both scale to 110 s at 1.1B
    assert eta.expected(past, 8_000_000_000, first_principles=999.0) == (999.0, "estimate")  # nothing near 8B
    assert eta.expected([], 1_000, first_principles=5.0) == (5.0, "estimate")


def test_a_jobs_wall_time_follows_the_packing_rule():
    units = [
        Unit("quantize:a", "quantize"),
        Unit("quantize:b", "quantize"),
        Unit("evaluate:a", "evaluate", frozenset({"quantize:a"})),
        Unit("evaluate:b", "evaluate", frozenset({"quantize:b"})),
        Unit("gate", "gate", frozenset({"evaluate:a", "evaluate:b"})),
    ]
    seconds = {"quantize:a": 100.0, "quantize:b": 100.0, "evaluate:a": 10.0, "evaluate:b": 10.0, "gate": 1.0}

    def need(unit: Unit) -> Need:
        return Need(gpu_bytes=4, cores=1) if unit.kind == "quantize" else Need(in_process=True)

    assert eta.wall_seconds(units, seconds, need, Packer(1, None, 8)) == 221.0  # one after another
    assert eta.wall_seconds(units, seconds, need, Packer(4, None, 8)) == 121.0  # both passes at once
    assert eta.wall_seconds(units, seconds, need, Packer(4, 6, 8)) == 211.0  # memory for one pass at a time


def test_the_critical_path_is_what_the_jobs_end_waited_on():
    """A measurement, three sizes after it with memory for two at a time, each size's evaluation after FP16's: the
    end waits on the third size, which waited for room (the first size's end), which waited for the measurement."""
    units = [
        Unit("measure:k", "measure"),
        *(Unit(f"quantize:{s}", "quantize", frozenset({"measure:k"})) for s in "abc"),
        Unit("evaluate:fp16", "evaluate"),
        *(Unit(f"evaluate:{s}", "evaluate", frozenset({f"quantize:{s}", "evaluate:fp16"})) for s in "abc"),
        Unit("gate", "gate", frozenset({"evaluate:a", "evaluate:b", "evaluate:c"})),
    ]
    seconds = {"measure:k": 50.0, "quantize:a": 40.0, "quantize:b": 60.0, "quantize:c": 40.0, "evaluate:fp16": 20.0}
    seconds |= {"evaluate:a": 5.0, "evaluate:b": 5.0, "evaluate:c": 5.0, "gate": 1.0}

    def need(unit: Unit) -> Need:
        return Need(gpu_bytes=4, cores=1) if unit.kind != "evaluate" else Need(gpu_bytes=1, in_process=True)

    slots = eta.schedule(units, seconds, need, Packer(8, 9, 16))
    when = {s.name: (s.start, s.end) for s in slots}
    assert when["evaluate:fp16"] == (0.0, 20.0) and when["quantize:a"] == (50.0, 90.0)
    assert when["quantize:c"] == (90.0, 130.0)  # room for two sizes beside FP16's evaluation: it waits for a's end
    path = [s.name for s in eta.critical_path(units, slots)]
    assert path == ["measure:k", "quantize:a", "quantize:c", "evaluate:c", "gate"]
    assert eta.packed(units, seconds, need, Packer(8, 9, 16)) == (136.0, 3)  # b, c and a's evaluation at 90 s


def test_an_evaluation_walked_layer_by_layer_is_predicted_by_its_largest_layer():
    """Llama-3-8B's shape, 48 windows: the whole model is 16 GB; walked a layer at a time, what packing admits the
    FP16 evaluation by is its embedding (1 GB), the windows' states (0.8 GB) and a window's logits as scoring uses
    them (4 x 1 GB in fp32). tests/gpu/test_gpu_kld.py checks the walk's measured peak against it on the GPU."""
    from factory.jobs.costs import Sized, evaluation_bytes
    from factory.vram import Params, Shape

    shape = Shape(
        hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, max_positions=8192
    )
    params = Params(embed=128256 * 4096, head=128256 * 4096, linear=32 * 218_103_808, other=32 * 8192 + 4096)
    model = Sized(shape, params, 2048, walkable=True)
    whole, walked = evaluation_bytes(model, 48, walked=False), evaluation_bytes(model, 48, walked=True)
    assert 17e9 < whole < 19e9  # 16 GB of weights, a window's logits
    assert 5.5e9 < walked < 6.5e9 and walked < whole / 2.5


def test_the_importance_matrix_is_expected_to_take_as_long_as_its_tokens():
    """llama-imatrix on the CPU is a forward pass over chunks x context tokens: a recipe's 16 x 512 is expected at
    an eighth of the default 128 x 512 (Gemma-3-270M's job was told 50 minutes for 16 chunks)."""
    from factory import engines
    from factory.engines.gguf.spec import GgufSpec

    memory, parameters = engines.get("gguf").memory, 268_000_000
    default = memory.unit_seconds("imatrix", parameters, "cpu", 1)
    assert memory.unit_seconds("imatrix", parameters, "cpu", 1, GgufSpec(type="Q4_K_M")) == default
    small = memory.unit_seconds("imatrix", parameters, "cpu", 1, GgufSpec(type="Q4_K_M", imatrix_chunks=16))
    assert abs((small - 10.0) * 8 - (default - 10.0)) < 1e-6
