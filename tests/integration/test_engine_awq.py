"""The AWQ engine: the CPU fix for AutoAWQ's saved state, a child that dies, a child that errors."""

import os
import signal

import pytest
import torch

from factory import engines, settings
from factory.engines.awq.quantize import _quantizer_cls
from factory.errors import JobFailed
from factory.factory import Factory
from factory.jobs.planning import Request
from factory.recipes import build_recipe
from tests.support import processes


def _bare_quantizer(cls):
    q = object.__new__(cls)
    q.w_bit, q.group_size, q.zero_point, q.duo_scaling = 4, 64, True, True
    q.n_parallel_calib_samples, q.max_chunk_memory = None, 1 << 30
    return q


@pytest.mark.parametrize("fixed", [True, False])
def test_grid_search_leaves_weights_as_they_were(fixed):
    """AutoAWQ's `_compute_best_scale` must restore the layer after each grid step. Stock AutoAWQ on a CPU saves
    the live tensors (`.cpu()` is a no-op there), so its search leaves scaled weights behind; ours does not."""
    from awq.quantize.quantizer import AwqQuantizer

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=False)
    before = linear.weight.detach().clone()
    x = torch.randn(32, 128) * torch.linspace(0.1, 10, 128)
    quantizer = _bare_quantizer(_quantizer_cls(lambda **e: None) if fixed else AwqQuantizer)
    with torch.no_grad():
        quantizer._compute_best_scale(x, linear.weight.abs().mean(0), x.abs().mean(0), linear, [linear], linear(x))
    assert torch.equal(linear.weight, before) is fixed


def test_engine_failure_is_a_failed_step(tiny, tmp_path):
    # a group size the spec refuses at submit, made past its checks to fail the child
    spec = engines.get("awq").spec.model_construct(group_size=96, clip=False)
    request = engines.QuantizeRequest(tiny, tmp_path / "out", tmp_path / "work", spec, [[1] * 32] * 2)
    with pytest.raises(JobFailed) as e:
        engines.get("awq").quantize(request, lambda event: None)
    assert e.value.message.startswith(
        "AWQ quantization (2 x 32 calibration tokens) failed: RuntimeError: shape '[-1, 96]' is invalid for input"
    )
    assert e.value.message.endswith(f"(exit 1; log: {tmp_path / 'work' / 'engine.log'})")
    assert (tmp_path / "work" / "engine.log").is_file()


def test_killed_engine_fails_the_job_and_the_job_runs_again(tiny, tmp_path, db_url, monkeypatch):
    monkeypatch.setenv("FACTORY_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FACTORY_DB_URL", db_url)
    monkeypatch.setenv("FACTORY_MAX_UNITS", "1")  # FP16's evaluation would otherwise run beside the quantization
    killed = []

    def kill_the_engine(event):
        if event["event"] == "progress" and event.get("unit") == "layer" and not killed:
            for child in processes.engines(os.getpid()):
                os.kill(child.pid, signal.SIGKILL)
                killed.append(child.pid)

    factory = Factory(settings.load(), kill_the_engine)
    job, created = factory.submit(Request(source=str(tiny), recipe=build_recipe(awq=True, eval_windows=1)))
    with pytest.raises(JobFailed, match=r"AWQ quantization .* failed: the engine process was killed by SIGKILL"):
        factory.execute(job.id)
    assert killed
    failed = factory.catalog.jobs.get(job.id)
    assert (failed.state, failed.exit_code) == ("failed", 1)
    assert [(s.name, s.state) for s in failed.steps] == [("inspect", "succeeded"), ("quantize:awq-w4g128", "failed")]
    assert factory.catalog.quants.live() == []

    again, created = factory.submit(Request(source=str(tiny), recipe=build_recipe(awq=True, eval_windows=1)))
    assert (again.id, created) == (job.id, False)
    done = factory.execute(job.id)
    assert done.state == "succeeded"
    assert [s.name for s in done.steps if s.state == "failed"] == ["quantize:awq-w4g128"]
    assert [q.tag for q in factory.catalog.quants.live()] == ["awq-w4g128"]
    assert not (tmp_path / "home" / "work" / job.id).exists()
