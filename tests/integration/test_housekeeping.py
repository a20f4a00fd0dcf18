"""Disk: `qf rm` removes one quant and nothing else, `qf gc` frees what finished work left behind, `qf pull` shares
the registry's files instead of doubling them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from factory import tables
from factory.publish import folder as registry
from tests.support import ROOT
from tests.support.qf import Qf


def last_line(result) -> str:
    return result.stderr.splitlines()[-1]


def _quant(qf: Qf, model) -> dict:
    result = qf("run", model, "--awq", "--eval-windows", 1, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.splitlines()[-1])["quants"][0]


def _two_revisions(qf: Qf, model_copy) -> tuple[dict, dict]:
    model = model_copy("tiny")
    first = _quant(qf, model)
    (model / "generation_config.json").write_text('{"do_sample": false}')  # another revision of the same model
    return first, _quant(qf, model)


def test_rm_removes_one_quant_and_nothing_else(qf, model_copy):
    first, second = _two_revisions(qf, model_copy)
    folders = {q["rev"]: qf.home / "registry" / q["path"] for q in (first, second)}
    assert all(f.is_dir() for f in folders.values())

    both = qf("rm", "tiny:awq-w4g128")
    assert both.exit_code == 2
    assert last_line(both) == (
        f"error: tiny:awq-w4g128 has 2 revisions ({second['rev']}, {first['rev']}); name one: qf rm tiny:awq-w4g128@REV"
    )
    result = qf("rm", f"tiny:awq-w4g128@{first['rev']}")
    assert result.exit_code == 0, result.output
    assert last_line(result).startswith(f"removed tiny:awq-w4g128@{first['rev']} (") and "KiB freed)" in result.stderr
    assert not folders[first["rev"]].exists() and folders[second["rev"]].is_dir()
    assert [(q["name"], q["rev"]) for q in qf.json("ls")] == [("tiny:awq-w4g128", second["rev"])]
    assert not list((qf.home / "registry" / "tiny").glob(".tmp-*"))
    gone = qf("rm", f"tiny:awq-w4g128@{first['rev']}")
    assert gone.exit_code == 4
    assert (
        last_line(gone) == f"error: tiny:awq-w4g128@{first['rev']} does not exist; tags of tiny: awq-w4g128@"
        f"{second['rev']}"
    )


def test_gc_frees_what_finished_work_left(qf, tiny, tmp_path):
    _quant(qf, tiny)
    work, download = qf.home / "work", qf.home / "cache" / "hub" / "meta--tiny" / ("a" * 40)
    (work / "0123456789ab").mkdir(parents=True)  # a job the catalog does not know
    (work / "0123456789ab" / "calibration.parquet").write_bytes(b"x" * 1000)
    download.mkdir(parents=True)  # a download no job needs
    (download / "model.safetensors").write_bytes(b"x" * 5000)
    stale = qf.home / "registry" / "tiny" / f"{registry.STAGING}awq-w4g128@abc-12345678"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"x" * 300)
    hour_ago = time.time() - registry.STALE_SECONDS - 60
    os.utime(stale, (hour_ago, hour_ago))

    [snapshot] = [p for p in (qf.home / "snapshots").iterdir() if not p.name.startswith(".")]  # the quant's job's
    snapshot_bytes = sum(p.stat().st_size for p in snapshot.iterdir())

    planned = qf.json("gc", "--dry-run")
    assert planned["dry_run"] and planned["bytes"] == 6300 + snapshot_bytes
    assert {(i["path"], i["why"]) for i in planned["items"]} == {
        (str(work / "0123456789ab"), "work folder of a job the catalog does not know"),
        (str(download), "Hub download that no unfinished job needs"),
        (str(stale), "staging of a publish that was killed"),
        (str(snapshot), "snapshot of a local source that no unfinished job needs"),
    }
    assert stale.exists() and (work / "0123456789ab").exists()
    done = qf("gc")
    assert done.exit_code == 0 and last_line(done) == f"freed {tables.size(6300 + snapshot_bytes)} in 4 places"
    assert not stale.exists() and not (work / "0123456789ab").exists() and not download.exists()
    assert not snapshot.exists()
    assert qf.json("gc")["items"] == [] and len(qf.json("ls")) == 1


def test_pull_shares_the_registry_files(finished, tmp_path):
    qf, _ = finished
    result = qf("pull", "tiny:awq-w4g128", "-o", tmp_path / "pulled")
    assert result.exit_code == 0, result.output
    [row] = qf.json("ls")
    src = qf.home / "registry" / row["path"] / "model.safetensors"
    pulled = tmp_path / "pulled" / "model.safetensors"
    same_fs = os.stat(src).st_dev == os.stat(tmp_path).st_dev
    assert not same_fs or os.path.samefile(src, pulled) or pulled.read_bytes() == src.read_bytes()
    assert oct(src.stat().st_mode & 0o777) == "0o444"  # a linked copy cannot change the registry by accident
    shutil.rmtree(tmp_path / "pulled")
    assert src.is_file()


def _stop_when_running(qf: Qf, step: str, child: subprocess.Popen, timeout: float = 300) -> None:
    """SIGSTOP `child` as soon as its catalog (SQLite in FACTORY_HOME, or the PostgreSQL of the test) shows `step`
    running."""
    from sqlalchemy import create_engine, exc, text

    url = qf.db_url or f"sqlite:///{qf.home / 'catalog.db'}"
    engine = create_engine(re.sub(r"^postgres(ql)?://", "postgresql+psycopg2://", url))
    query = text("SELECT 1 FROM steps WHERE name = :step AND state = 'running'")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and child.poll() is None:
            if qf.db_url or (qf.home / "catalog.db").exists():
                try:
                    with engine.connect() as conn:
                        if conn.execute(query, {"step": step}).first():
                            os.kill(child.pid, signal.SIGSTOP)
                            return
                except exc.DBAPIError:  # the tables are not made yet
                    pass
            time.sleep(0.01)
    finally:
        engine.dispose()
    raise AssertionError(f"{step} never ran: {child.communicate()}")


@pytest.mark.database
def test_rm_of_a_quant_another_job_evaluates_fails_that_job_in_one_sentence(qf, tiny):
    """A second job of the same weights (another eval length) reuses the published quant and evaluates it from the
    registry; `qf rm` of it meanwhile fails that job in one sentence, not a traceback (issue 43)."""
    first = _quant(qf, tiny)
    again = subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "run", str(tiny), "--awq", "--eval-windows", "2"],
        env={**os.environ, **qf.env},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _stop_when_running(qf, "evaluate:awq-w4g128", again)  # stopped as its evaluation starts
        removed = qf("rm", f"tiny:awq-w4g128@{first['rev']}")
        assert removed.exit_code == 0, removed.output
    finally:
        os.kill(again.pid, signal.SIGCONT)
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 1, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        "error: tiny:awq-w4g128 was removed while this job evaluated it; run the same command again to make it"
    )
    assert qf.json("ls") == []


@pytest.mark.database
def test_a_publish_killed_before_its_row_is_recovered_and_its_folder_collected(qf, model_copy):
    """`qf run` SIGKILLed with its quant's registry folder in place and the folder's row not recorded: once its lease
    runs out, `qf status` shows the job queued again (it stayed `running` for ever: no reconciler runs beside `qf
    run`); `qf gc` leaves the unlisted folder during the grace period (a publish may be recording its row) and
    removes it after; running the job again publishes the quant."""
    from tests.support.processes import stopped_at

    model, run = model_copy("tiny"), ("--awq", "--eval-windows", 1)
    proc = stopped_at(qf, "placed", model, *run, FACTORY_LEASE_SECONDS="2")
    proc.kill()
    proc.wait(30)
    [placed] = (qf.home / "registry" / "tiny").glob("awq-w4g128@*")
    assert qf.json("ls") == []
    time.sleep(2.5)  # the lease runs out
    [job] = qf.json("status")
    assert job["state"] == "queued" and job["holder"] is None

    why = "registry folder that no catalog row lists (a publish killed before recording it)"
    assert (str(placed), why) not in {(i["path"], i["why"]) for i in qf.json("gc", "--dry-run")["items"]}
    hour_ago = time.time() - registry.STALE_SECONDS - 60
    os.utime(placed, (hour_ago, hour_ago))
    assert (str(placed), why) in {(i["path"], i["why"]) for i in qf.json("gc", "--dry-run")["items"]}
    assert placed.is_dir()
    assert (str(placed), why) in {(i["path"], i["why"]) for i in qf.json("gc")["items"]}
    assert not placed.exists() and not list((qf.home / "registry").glob(f"*/{registry.STAGING}*"))

    again = qf("run", model, *run)
    assert again.exit_code == 0, again.output
    [quant] = qf.json("ls")
    registry.verify(qf.home / "registry" / quant["path"])
    assert qf.json("status")[0]["state"] == "succeeded"
