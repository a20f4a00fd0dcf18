"""A card kept busy (issue 47): what does not need a measurement runs while it runs, with the test engines of
tests/support/round_engine.py (a real `qf run`, real engine children); the units of several job processes pack together
through the machine's ledger (factory/jobs/ledger.py), real processes sharing one file; `qf worker --slots` auto and
its refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from datetime import datetime

import pytest

from factory.cli import slots
from factory.errors import SpecError
from factory.jobs import packing
from factory.jobs.graph import Unit
from factory.jobs.ledger import Ledger
from factory.jobs.packing import Need, Packer
from tests.support import ROOT

GiB = 2**30


@pytest.fixture
def both_round_engines():
    from factory import engines
    from tests.support.round_engine import ENGINE, MEASURED

    engines.register(ENGINE)
    engines.register(MEASURED)
    yield
    engines.unregister(MEASURED.name)
    engines.unregister(ENGINE.name)


def _spans(qf, job_id: str) -> dict[str, tuple[float, float]]:
    spans = {}
    for step in qf.json("status", job_id)["steps"]:
        start = datetime.fromisoformat(step["started_at"]).timestamp()
        spans[step["name"]] = (start, start + step["seconds"])
    return spans


@pytest.mark.parametrize("max_units", [4, 1])
def test_what_needs_no_measurement_runs_while_it_runs(qf, tiny, tmp_path, both_round_engines, monkeypatch, max_units):
    """A job of a measured size (mround) and one without (round): the other conversion, FP16's evaluation (its KL
    reference) and the other size's evaluation start while the measurement runs; one unit at a time, nothing
    does."""
    monkeypatch.setenv("QF_TEST_MEASURE_SECONDS", "8")
    recipe = tmp_path / "both.yaml"
    recipe.write_text("round: {mantissa: [3]}\nmround: {mantissa: [5]}\nmax_ppl_ratio: 100.0\n")
    result = qf("run", tiny, "--recipe", recipe, "--eval-windows", 1, "--max-units", max_units, "--json")
    assert result.exit_code == 0, result.output
    spans = _spans(qf, qf.json("ls")[0]["job"])
    [measure] = [span for name, span in spans.items() if name.startswith("measure:")]
    during = {name for name, (start, end) in spans.items() if start < measure[1] and measure[0] < end}
    during -= {name for name in spans if name.startswith("measure:")}
    if max_units == 1:
        assert during == set()
    else:
        assert {"quantize:round-m3", "evaluate:fp16", "evaluate:round-m3"} <= during, spans
        assert spans["quantize:mround-m5"][0] >= measure[1]  # the measured size waits for its measurement


# -- the ledger: units of several processes on one card --------------------------------------------------------------


def test_the_ledger_counts_other_processes_units_and_forgets_dead_ones(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    entry = {"gpu_bytes": 6 * GiB, "cores": 2, "alone": False}
    (tmp_path / "ledger.json").write_text(
        json.dumps(
            {f"{os.getppid()}:quantize:a": {"pid": os.getppid(), **entry}, "9:x": {"pid": int(dead.stdout), **entry}}
        )
    )
    assert ledger.others() == [Need(6 * GiB, 2)]  # the parent's unit; the finished process's is gone
    packer = Packer(8, 10 * GiB, 16)
    four = Need(4 * GiB, 1)
    assert ledger.take(f"{os.getpid()}:quantize:b", four, lambda others: packer.admits(four, others))
    assert not ledger.take(f"{os.getpid()}:quantize:c", four, lambda others: packer.admits(four, [four, *others]))
    assert ledger.others() == [Need(6 * GiB, 2)]  # this process's own units are its own to count
    ledger.give_back(f"{os.getpid()}:quantize:b")
    assert f"{os.getpid()}:quantize:b" not in json.loads((tmp_path / "ledger.json").read_text())
    (tmp_path / "ledger.json").write_text('{"12:quantize:a": {"pid": 1')  # a writer killed mid-write
    assert ledger.others() == []


def test_a_unit_alone_on_the_card_keeps_every_process_out(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")
    parent = os.getppid()
    (tmp_path / "ledger.json").write_text(
        json.dumps({f"{parent}:quantize:a": {"pid": parent, "gpu_bytes": GiB, "cores": 1, "alone": True}})
    )
    small = Need(GiB, 1)
    assert not ledger.take(f"{os.getpid()}:x", small, lambda others: Packer(8, 80 * GiB, 16).admits(small, others))


PROCESS = textwrap.dedent(
    """
    import json, sys, threading, time
    from pathlib import Path
    from factory.jobs import packing
    from factory.jobs.graph import Unit
    from factory.jobs.ledger import Ledger
    from factory.jobs.packing import Need, Packer

    ledger, out, name = Ledger(Path(sys.argv[1])), sys.argv[2], sys.argv[3]
    spans, waited = {}, []
    # both processes start their units together, however long each took to import
    Path(out + ".ready").touch()
    while len(list(Path(out).parent.glob("*.ready"))) < 2:
        time.sleep(0.05)

    def work(unit):
        start = time.time()
        time.sleep(1.0)
        spans[unit.name] = (start, time.time())

    units = [Unit(f"quantize:{name}{i}", "quantize") for i in range(3)]
    packing.WAITING_EVERY_SECONDS = 0.2
    packing.DEFERRED_POLL_SECONDS = 0.05  # the waiting process looks for room often within a unit's second, however
    # late a loaded machine wakes it (at 1 s, as in a job, it could sleep past the one second the room was free)
    packing.run(units, work, lambda u: Need(4 * 2**30, 1), Packer(8, 10 * 2**30, 16), threading.Event(),
                ledger=ledger, waiting=waited.append)
    json.dump({"spans": spans, "waited": waited}, open(out, "w"))
    """
)


def test_units_of_two_job_processes_share_the_card_by_their_needs(tmp_path):
    """Two processes, three units of 4 GiB each, a card with room for 10: never more than two at once between them
    (each process alone would run two of its own at once), and a process kept waiting says so."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PROCESS, str(tmp_path / "ledger.json"), str(tmp_path / f"{n}.json"), n], env=env
        )
        for n in ("a", "b")
    ]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    results = [json.loads((tmp_path / f"{n}.json").read_text()) for n in ("a", "b")]
    spans = [span for r in results for span in r["spans"].values()]
    assert len(spans) == 6
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most == 2
    assert any(
        s0 < e1 and s1 < e0 for s0, e0 in results[0]["spans"].values() for s1, e1 in results[1]["spans"].values()
    )
    assert any(r["waited"] for r in results)  # the one kept waiting said so
    assert json.loads((tmp_path / "ledger.json").read_text()) == {}  # every unit gave its room back


def test_a_unit_that_fails_gives_its_room_back(tmp_path):
    ledger = Ledger(tmp_path / "ledger.json")

    def work(unit: Unit) -> None:
        raise RuntimeError("broke")

    with pytest.raises(RuntimeError, match="broke"):
        packing.run(
            [Unit("quantize:a", "quantize"), Unit("quantize:b", "quantize")],
            work,
            lambda unit: Need(GiB, 1),
            Packer(4, 10 * GiB, 4),
            threading.Event(),
            ledger=ledger,
        )
    assert json.loads((tmp_path / "ledger.json").read_text()) == {}


# -- qf worker --slots ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, cores, count", [("auto", 2, 1), ("auto", 16, 4), ("auto", 128, 4), ("3", 2, 3)])
def test_slots(value, cores, count):
    assert slots.count(value, cores) == count


@pytest.mark.parametrize("value", ["0", "two", "-1", ""])
def test_slots_that_are_neither_a_number_nor_auto_are_refused(value):
    with pytest.raises(SpecError, match=f"--slots {value!r} is neither a positive number nor auto"):
        slots.count(value, 16)


def test_qf_worker_refuses_bad_slots_before_it_reaches_anything(tmp_path):
    env = {**os.environ, "FACTORY_HOME": str(tmp_path), "FACTORY_BROKER_URL": "redis://127.0.0.1:1/0"}
    result = subprocess.run(
        [sys.executable, "-m", "factory.cli", "worker", "--slots", "two"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert (result.returncode, result.stderr.strip()) == (
        2,
        "error: --slots 'two' is neither a positive number nor auto",
    )


def test_each_card_has_its_own_ledger():
    assert slots.ledger_path("0") != slots.ledger_path("1") != slots.ledger_path(None)
    assert slots.ledger_path("0,1").name == f"quantfactory-{os.getuid()}-gpu-0-1.json"


@pytest.mark.parametrize(
    "max_units, device, processes", [(None, "cuda", 4), (2, "cuda", 4), (1, "cuda", 1), (None, "cpu", 1)]
)
def test_a_measurement_runs_its_ranges_at_once_unless_one_unit_at_a_time(max_units, device, processes):
    """EXL2's measurement in layer ranges (factory/engines/exl2/ranges.py) takes a process per core its engine asks
    for; `--max-units 1` runs one process after another, as before packing, and its expected seconds say so."""
    from types import SimpleNamespace

    from factory import engines
    from factory.jobs.costs import Costs

    exl2, job = engines.get("exl2"), SimpleNamespace(device=device)
    costs = Costs(None, max_units)
    costs.machine_cores = 16  # a GPU machine's
    assert costs.measure_processes(exl2, job) == processes
    costs.machine_cores = 2  # no more processes than cores
    assert costs.measure_processes(exl2, job) == min(processes, 2)
    serial = exl2.memory.unit_seconds("measure", int(1.1e9), "cuda", 1)
    assert serial == pytest.approx(sum(exl2.memory.UNIT_SECONDS["measure"][i] * (1, 1.1)[i] for i in (0, 1)))
    assert (exl2.memory.unit_seconds("measure", int(1.1e9), "cuda", processes) < serial) is (processes > 1)


def test_one_unit_at_a_time_still_holds_its_room_and_waits_for_it(tmp_path):
    """A job run one unit at a time (--max-units 1) in a slot: each unit waits for room beside the other processes'
    units, and holds its room in the ledger while it runs."""
    ledger, path, parent = Ledger(tmp_path / "ledger.json"), tmp_path / "ledger.json", os.getppid()
    path.write_text(
        json.dumps({f"{parent}:quantize:x": {"pid": parent, "gpu_bytes": 8 * GiB, "cores": 1, "alone": False}})
    )
    seen: list[dict] = []

    def work(unit: Unit) -> None:
        seen.append(json.loads(path.read_text()))

    units = [Unit("quantize:a", "quantize")]
    pool = threading.Thread(
        target=packing.run,
        args=(units, work, lambda u: Need(4 * GiB, 1), Packer(1, 10 * GiB, 16), threading.Event()),
        kwargs={"ledger": ledger},
    )
    pool.start()
    pool.join(timeout=2.5)
    assert pool.is_alive() and seen == []  # 8 + 4 GiB do not fit in 10
    ledger.give_back(f"{parent}:quantize:x")  # the other process's unit ended
    pool.join(timeout=10)
    assert not pool.is_alive()
    assert list(seen[0]) == [f"{os.getpid()}:quantize:a"]  # held while it ran
    assert json.loads(path.read_text()) == {}
