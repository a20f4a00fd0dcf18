"""A quant's source identity is the hash of the bytes that were quantized and evaluated (issue 43, item 1): weights
rewritten in place with the same size and their mtime put back (what a (path, size, mtime) hash cache cannot see)
are never quantized, evaluated or published under the identity of the bytes they replaced, and a second user's clean
copy of the model never reuses a quant made from them. Real `qf run` processes with the round engine
(tests/support/round_engine.py: deterministic, so the same bytes make the same quant)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

import pytest

from factory import tables
from factory.checkpoints import files
from factory.errors import JobFailed
from factory.identity import file_sha256
from tests.support.processes import events_until, qf_process
from tests.support.qf import Qf

ROUND = {"FACTORY_ENGINES": "tests.support.round_engine:ENGINE"}
SIZES = {"F16": 2, "BF16": 2, "F32": 4}


def _rewrite_in_place(path: Path) -> None:
    """Other weights of the same size (every tensor negated: its elements' sign bits flipped), written into the same
    file, with its atime and mtime put back."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    for name, info in json.loads(data[8 : 8 + n]).items():
        if name == "__metadata__":
            continue
        size = SIZES[info["dtype"]]
        start, end = (8 + n + o for o in info["data_offsets"])
        for i in range(start + size - 1, end, size):  # little-endian: the sign is the last byte's top bit
            data[i] ^= 0x80
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size


def _run(qf: Qf, model: Path, recipe: Path, *args: object, rewrite_at: str | None = None):
    """`qf run` of `model` with the round engine; with `rewrite_at`, its weights are rewritten in place once that
    step started (before the engine's child has read them)."""
    proc = qf_process(qf, "run", model, "--recipe", recipe, "--eval-windows", 1, *args, "--json", env=ROUND,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        if rewrite_at:
            events_until(proc, rewrite_at)
            _rewrite_in_place(model / "model.safetensors")
        out, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _published(qf: Qf, name: str) -> dict:
    """The published quant `name` (model:tag): its weights' sha256 and the source identity its manifest gives."""
    [quant] = [q for q in qf.json("ls") if q["name"] == name]
    return {
        "weights": file_sha256(qf.home / "registry" / quant["path"] / "model.safetensors"),
        "source": json.loads((qf.home / "registry" / quant["path"] / "manifest.json").read_text())["source_identity"],
    }


def test_weights_rewritten_after_inspect_are_not_what_is_quantized_nor_reused(model_copy, tmp_path, db_url):
    """The weights are rewritten in place (same size, mtime restored) once the quantize step started, after inspect:
    the job quantizes and evaluates the bytes it hashed, so its quant is the one a clean copy makes elsewhere, and
    a second user's clean copy that reuses it reuses those weights."""
    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [3]}\nmax_ppl_ratio: 100.0\n")
    clean = Qf(home=tmp_path / "clean-home", db_url=db_url)
    done = _run(clean, model_copy("reference"), recipe)
    assert done.returncode == 0, done.stderr
    expected = _published(clean, "reference:round-m3")

    qf = Qf(home=tmp_path / "home", db_url=db_url)
    attacked = _run(qf, model_copy("tiny"), recipe, rewrite_at="quantize:round-m3")
    assert attacked.returncode == 0, attacked.stderr
    assert _published(qf, "tiny:round-m3") == expected

    second = _run(qf, model_copy("copy"), recipe, "--eval-windows", 2)  # another job, the same weights key
    assert second.returncode == 0, second.stderr
    assert "reused tiny:round-m3" in second.stdout
    assert _published(qf, "tiny:round-m3") == expected


def test_weights_rewritten_before_the_job_reads_them_fail_it_in_one_sentence(qf, model_copy, tmp_path):
    """The hash cache knows the folder's weights (an earlier job hashed them); they are rewritten in place with the
    same size and mtime; the next job of that folder (submitted under the identity the cache gives) fails with one
    sentence naming the file, exit 3, and publishes nothing; a clean copy's job then makes its own quant."""
    recipe = tmp_path / "round.yaml"
    recipe.write_text("round: {mantissa: [3]}\nmax_ppl_ratio: 100.0\n")
    model = model_copy("tiny")
    first = _run(qf, model, recipe)
    assert first.returncode == 0, first.stderr
    made = _published(qf, "tiny:round-m3")
    [recorded] = (qf.home / "cache" / "inspected").iterdir()  # what submit inspected, under the identity

    _rewrite_in_place(model / "model.safetensors")
    recipe.write_text("round: {mantissa: [5]}\nmax_ppl_ratio: 100.0\n")
    refused = _run(qf, model, recipe)
    assert refused.returncode == 3, refused.stderr
    assert refused.stderr.splitlines()[-1] == (
        f"error: source folder {str(model)!r} changed since the job was submitted: model.safetensors is not what "
        "was hashed then; submit it again"
    )
    assert [q["name"] for q in qf.json("ls")] == ["tiny:round-m3"]
    assert not recorded.exists()  # it described the rewritten bytes under the old identity: forgotten with them

    again = _run(qf, model, recipe)  # the cache forgot the file: submitted again, the job is of what is there now
    assert again.returncode == 0, again.stderr
    assert _published(qf, "tiny:round-m5")["source"] != made["source"]

    copy = _run(qf, model_copy("copy"), recipe, "--eval-windows", 2)
    assert copy.returncode == 0, copy.stderr
    assert "reused tiny:" not in copy.stdout  # tiny:round-m5 is of other bytes
    assert "the snapshot of this source an earlier job made is reused" in copy.stdout  # the first job's, same bytes
    assert _published(qf, "copy:round-m5")["source"] == made["source"]
    assert _published(qf, "tiny:round-m3") == made


def test_a_snapshot_between_filesystems_the_kernel_cannot_copy_across(model_copy, tmp_path):
    """A source on tmpfs (/dev/shm) snapshot onto the job's filesystem: the kernel refuses the copy (EXDEV), so the
    snapshot reads, hashes and writes in one pass; the copies are the source's bytes and their hashes."""
    shm = Path(tempfile.mkdtemp(prefix="qf-test-", dir="/dev/shm"))
    try:
        model = shutil.copytree(model_copy("tiny"), shm / "tiny")
        weights = model / "model.safetensors"
        with open(weights, "rb") as f, open(tmp_path / "probe", "wb") as out:
            with pytest.raises(OSError) as refused:
                os.copy_file_range(f.fileno(), out.fileno(), 1 << 20)
        assert refused.value.errno == errno.EXDEV
        hashes = files.snapshot(model, tmp_path / "snapshot")
        assert hashes == {p.name: file_sha256(p) for p in sorted(model.iterdir()) if files.is_source_file(p.name)}
        assert all((tmp_path / "snapshot" / n).read_bytes() == (model / n).read_bytes() for n in hashes)
    finally:
        shutil.rmtree(shm)


def test_a_snapshot_that_fills_the_disk_fails_in_one_sentence(model_copy, tmp_path):
    """The job's copy needs the checkpoint's size again: on a disk too small for it (a 512 KiB tmpfs, mounted here:
    the tests run as root) the snapshot is JobFailed in one sentence and leaves nothing behind."""
    model, small = model_copy("tiny"), tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(small)], check=True)
    try:
        with pytest.raises(JobFailed) as failed:
            files.snapshot(model, small / "work" / "source")
        size = sum(p.stat().st_size for p in model.iterdir() if files.is_source_file(p.name))
        assert failed.value.message == (
            f"no space left in {small / 'work'} for the job's copy of {model} ({tables.size(size)}); free some "
            "(qf gc removes finished jobs' work folders) and run it again"
        )
        assert list((small / "work" / "source").iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_jobs_of_one_folder_read_one_snapshot_on_disk(qf, model_copy, tmp_path):
    """Three jobs of one folder (a size each) read one copy of it: the first makes the snapshot in
    FACTORY_HOME/snapshots, the others read the folder again (it must still hold the job's bytes) and link the
    snapshot, so a running job's staging files are the snapshot's inodes (three jobs of a 14 GB 8B, a copy each,
    filled a 64 GB disk). `qf gc` then removes the snapshot, which no unfinished job needs."""
    recipe, model = tmp_path / "round.yaml", model_copy("tiny")
    outs = []
    for mantissa in (3, 4):
        recipe.write_text(f"round: {{mantissa: [{mantissa}]}}\nmax_ppl_ratio: 100.0\n")
        done = _run(qf, model, recipe)
        assert done.returncode == 0, done.stderr
        outs.append(done.stdout)
    assert ["snapshot of this source an earlier job made is reused" in out for out in outs] == [False, True]
    [shared] = [p for p in (qf.home / "snapshots").iterdir() if not p.name.startswith(".")]
    made = {p.name: p.stat().st_ino for p in shared.iterdir() if p.name != ".quantfactory-snapshot"}
    assert set(made) == {p.name for p in model.iterdir() if files.is_source_file(p.name)}

    recipe.write_text("round: {mantissa: [5]}\nmax_ppl_ratio: 100.0\n")
    proc = qf_process(qf, "run", model, "--recipe", recipe, "--eval-windows", 1, "--json", env=ROUND,
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        events_until(proc, "quantize:round-m5")
        [staging] = (qf.home / "work").glob("*/source")
        assert {p.name: p.stat().st_ino for p in staging.iterdir()} == made
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    finally:
        proc.kill()

    planned = qf.json("gc", "--dry-run")
    assert [(Path(i["path"]), i["why"]) for i in planned["items"]] == [
        (shared, "snapshot of a local source that no unfinished job needs")
    ]
    assert planned["bytes"] == sum(p.stat().st_size for p in shared.iterdir())
    qf("gc")
    assert not shared.exists()
