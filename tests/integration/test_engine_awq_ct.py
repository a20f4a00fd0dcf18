"""The AWQ-CT engine (llm-compressor's AWQ, written as compressed-tensors), for real: `qf run --awqct` end to end on
the tiny Llama, then what transformers (5.17, from the engine's own packages) makes of the pulled quant; the child's
packages, made once; the mixtures of experts its mappings name, each a tiny checkpoint of tests/support/tiny_archs.py
that the engine quantizes and scores; SmolLM2-135M's first layers on the CPU against the AutoAWQ quant's numbers; a
child that fails. And the packages' folder as another user of the machine or a package index may try to spoil it (a
second uid, stand-in wheels and an index that never answers: tests/support/fake_index.py): nothing planted runs,
nothing is followed, an install stops on SIGTERM or after its time, a damaged folder is installed again."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from calibration import builtin_text
from factory import engines
from factory.checkpoints.inspection import inspect
from factory.engines.awq_ct import env
from factory.engines.awq_ct.engine import ARCHITECTURES
from factory.errors import JobFailed
from factory.evaluation import evaluate
from tests.support import ROOT, fake_index, hostile_user
from tests.support.tiny_archs import make_tiny

ENGINE = engines.get("awqct")
# what a process of the victim's runs to get the packages: the folder, or the one sentence and exit 1
ENSURE = """
from factory.engines.awq_ct import env
from factory.errors import JobFailed
try:
    print(env.ensure())
except JobFailed as e:
    print(e.message)
    raise SystemExit(1)
"""


def _tensor_names(folder) -> set[str]:
    names = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def _windows(folder, rows: int, length: int) -> list[list[int]]:
    ids = evaluate.tokenize(folder, builtin_text("c4"))
    return [ids[i * length : (i + 1) * length] for i in range(rows)]


# transformers as the engine's child has it (factory/engines/awq_ct/env.py: 5.17), loading a pulled quant as a user
# would and writing its config and logits: the factory's own transformers (5.23 and later) refuses the zero points.
TRANSFORMERS_LOADS = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM
folder, ids, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
with torch.inference_mode():
    config = json.loads(model.config.to_json_string())["quantization_config"]
    torch.save({"version": transformers.__version__, "config": config, "logits": model(torch.tensor([ids])).logits},
               out)
"""


def test_qf_run_quantizes_scores_publishes_and_transformers_loads_the_pulled_quant(qf, tiny, tmp_path):
    result = qf("run", tiny, "--awqct", "--eval-windows", 2, "--json")
    assert result.exit_code == 0, result.output
    [row] = qf.json("ls")
    assert (row["name"], row["method"], row["bits"]) == ("tiny:awqct-w4g128", "awqct", 4.0)
    assert row["fp16_ppl"] < row["ppl"] < 1.5 * row["fp16_ppl"]
    assert row["kld"] is not None and 0 < row["kld"] < 0.5 and 0.5 < row["top1"] <= 1
    steps = {s["name"] for s in qf.json("status", row["job"])["steps"]}
    assert {"quantize:awqct-w4g128", "evaluate:fp16", "evaluate:awqct-w4g128", "publish:awqct-w4g128"} <= steps

    result = qf("pull", "tiny:awqct-w4g128", "-o", tmp_path / "pulled")
    assert result.exit_code == 0, result.output
    pulled = tmp_path / "pulled"
    assert {"recipe.yaml", "tokenizer.json", "README.md"} <= {p.name for p in pulled.iterdir()}
    ids = evaluate.tokenize(pulled, builtin_text("wiki"))[:256]
    out = tmp_path / "transformers.pt"
    done = subprocess.run(
        [sys.executable, "-c", TRANSFORMERS_LOADS, str(pulled), json.dumps(ids), str(out)],
        env={**os.environ, **env.child_path()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = torch.load(out)
    assert loaded["version"] == "5.17.0"
    qc = loaded["config"]
    [group] = qc["config_groups"].values()
    assert (qc["quant_method"], qc["format"], qc["ignore"]) == ("compressed-tensors", "pack-quantized", ["lm_head"])
    assert {k: group["weights"][k] for k in ("num_bits", "group_size", "symmetric", "strategy")} == {
        "num_bits": 4,
        "group_size": 128,
        "symmetric": False,
        "strategy": "group",
    }
    # what transformers decompresses is what the factory scored (the engine's own decompression, layer by layer)
    with torch.inference_mode():
        [ours] = ENGINE.load(pulled, "cpu").logits([ids])
    assert torch.allclose(loaded["logits"], ours, atol=1e-3)


def test_the_child_has_its_own_transformers_and_makes_its_packages_once():
    """The child's path starts with the engine's packages (transformers 5.17 for llm-compressor 0.14.0.1), made
    once in a folder keyed by the pins; the factory's own environment is left as it is."""
    first = env.ensure()
    assert first == env.folder() and (first / env.DONE).read_text().split() == list(env.PINS)
    stamp = (first / env.DONE).stat().st_mtime_ns
    path = env.child_path()["PYTHONPATH"].split(os.pathsep)
    assert path[0] == str(first) and (first / env.DONE).stat().st_mtime_ns == stamp  # not made again
    code = "import transformers, llmcompressor, compressed_tensors; print(transformers.__version__)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env.child_path()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.split()[-1] == "5.17.0", done.stderr[-2000:]
    assert ENGINE.version() == "llmcompressor 0.14.0.1, compressed-tensors 0.19.0, transformers 5.17.0"


def test_the_grid_search_losses_stay_finite_at_an_8b_width_in_float16():
    """llm-compressor's AWQ sums a candidate's squared error in the activations' dtype: in float16, one window of an
    8B's hidden width (512 x 4096) with errors of 0.25 already sums past 65504, so every candidate's loss is inf and
    AWQ stops ("No finite loss was found": the H100 sitting of 2026-12-06). The child sums them in float32."""
    code = """
import torch
from llmcompressor.modifiers.transform.awq.base import AWQModifier
from factory.engines.awq_ct.quantize import losses_in_float32
torch.manual_seed(0)
fp16 = [torch.randn(1, 512, 4096).half() for _ in range(2)]
int_w = [(t.float() + 0.25 * torch.randn(t.shape)).half() for t in fp16]
exact = sum(((a.double() - b.double()) ** 2).sum() for a, b in zip(fp16, int_w)).item() / (2 * 512 * 4096)
before = AWQModifier._compute_loss(None, fp16, int_w)
losses_in_float32()
losses_in_float32()  # twice is once
after = AWQModifier._compute_loss(None, fp16, int_w)
print(before, after, exact)
"""
    env.ensure()
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env.child_path()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, exact = map(float, done.stdout.split()[-3:])
    assert math.isinf(before)
    assert after == pytest.approx(exact, rel=1e-4)


# The mixtures of experts: tests/support/tiny_archs.py model type -> the router's name and an expert's linear names in
# the checkpoint (experts quantized, routers not; Mixtral keeps its own w1/w3/w2).
MOE = {
    "qwen3_moe": ("mlp.gate", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.gate", ("w1", "w3", "w2")),
    "deepseek_v3": ("mlp.gate", ("gate_proj", "up_proj", "down_proj")),
    "glm4_moe": ("mlp.gate", ("gate_proj", "up_proj", "down_proj")),
}


@pytest.fixture(scope="module")
def moe_quant(tmp_path_factory):
    """model type -> (its tiny FP16 checkpoint, the AWQ-CT quant the engine made of it)."""
    made = {}

    def make(model_type: str):
        if model_type not in made:
            base = tmp_path_factory.mktemp(model_type)
            source = make_tiny(model_type, base / "fp16")
            info = inspect(source, ENGINE.architectures)
            spec = ENGINE.resolve(ENGINE.spec(calib_rows=4, calib_length=64), info, "cpu")
            assert spec.tag == "awqct-w4g128"
            request = engines.QuantizeRequest(source, base / "quant", base / "work", spec, _windows(source, 4, 64))
            ENGINE.quantize(request, lambda event: None)
            made[model_type] = source, base / "quant"
        return made[model_type]

    return make


@pytest.mark.parametrize("model_type", sorted(MOE))
def test_a_mixture_of_experts_is_quantized_and_scores_like_its_source(moe_quant, model_type):
    source, quant = moe_quant(model_type)
    config = json.loads((quant / "config.json").read_text())
    assert config["architectures"][0] in ARCHITECTURES
    router, linears = MOE[model_type]
    names = _tensor_names(quant)
    assert f"model.layers.1.{router}.weight" in names  # the router stays as it was
    expert = f"model.layers.1.{router.rsplit('.', 1)[0]}.experts.0"
    assert {f"{expert}.{linear}.weight_packed" for linear in linears} <= names
    assert {f"{expert}.{linear}.weight_zero_point" for linear in linears} <= names
    assert not any(name.startswith(expert) and name.endswith(".weight") for name in names)
    # scored as the factory scores it: the engine's decompression against the FP16 source, on the same windows
    data = evaluate.Stream(_windows(source, 2, 256))
    fp16 = evaluate.perplexity(evaluate.load_fp16(source, "cpu"), data)
    ppl = evaluate.perplexity(ENGINE.load(quant, "cpu"), data)
    assert math.isfinite(ppl) and abs(ppl / fp16 - 1) < 0.05, (ppl, fp16)


def test_the_mixtures_of_experts_tested_here_are_claimed():
    """The engine's claims are what benchmarks/coverage.py proved (tests/integration/test_coverage.py); the layouts
    checked here are among them."""
    names = {
        "qwen3_moe": "Qwen3MoeForCausalLM",
        "mixtral": "MixtralForCausalLM",
        "deepseek_v3": "DeepseekV3ForCausalLM",
        "glm4_moe": "Glm4MoeForCausalLM",
    }
    assert {"LlamaForCausalLM"} | {names[t] for t in MOE} <= ARCHITECTURES


def test_a_failing_child_is_a_failed_step(tiny, tmp_path):
    # a group size the spec refuses at submit (96 divides none of its dims), made past the checks to fail the child
    spec = ENGINE.spec.model_construct(group_size=96, calib_rows=2, calib_length=32)
    request = engines.QuantizeRequest(tiny, tmp_path / "out", tmp_path / "work", spec, _windows(tiny, 2, 32))
    with pytest.raises(JobFailed) as e:
        ENGINE.quantize(request, lambda event: None)
    assert e.value.message.startswith("AWQ-CT quantization (2 x 32 calibration tokens) failed: ")
    assert e.value.message.endswith(f"(exit 1; log: {tmp_path / 'work' / 'engine.log'})")


@pytest.mark.smollm2
def test_smollm2_lands_where_autoawq_does(smollm2_cut_job):
    """SmolLM2-135M cut to its first 4 layers (real weights: tests/conftest.py `smollm2_cut_job`), w4 g64 (128 does
    not divide 576), the same 8 x 128 calibration tokens and windows as the AutoAWQ quant of the same job, on the
    CPU. Cut, the model predicts no text (FP16's perplexity is in the millions, and a quant's may fall below it), so
    the engines are compared on how far each moves the model's outputs: KLD and top-1 against FP16, and perplexity
    (2026-12-06, 4 windows: KLD 0.0481 against AutoAWQ's 0.0484, top-1 0.879 against 0.875, perplexity 0.9% apart;
    on the whole model, 2026-12-03: KLD 0.1587 against 0.1546, ppl 14.390 against 14.353)."""
    qf, rows = smollm2_cut_job
    row, autoawq = rows["awqct"], rows["awq"]
    model = row["name"].split(":")[0]
    assert row["name"] == f"{model}:awqct-w4g64" and autoawq["name"] == f"{model}:awq-w4g64"
    assert row["fp16_ppl"] == autoawq["fp16_ppl"]  # one FP16 evaluation, the same windows
    print(
        f"{model}: AWQ-CT ppl {row['ppl']:.3f}, KLD {row['kld']:.4f}, top-1 {row['top1']:.3f}; AutoAWQ ppl "
        f"{autoawq['ppl']:.3f}, KLD {autoawq['kld']:.4f}, top-1 {autoawq['top1']:.3f} (fp16 {row['fp16_ppl']:.3f})"
    )
    assert 0 < row["kld"] < 1.2 * autoawq["kld"] and row["top1"] > autoawq["top1"] - 0.02
    assert row["ppl"] == pytest.approx(autoawq["ppl"], rel=0.05)
    text = (qf.home / "registry" / row["path"] / "README.md").read_text()
    assert "builtin:c4, 8 x 128 tokens" in text and "vllm serve" in text


# -- the packages' folder, attacked --------------------------------------------------------------------------------


@pytest.fixture
def shared():
    """A folder every user can reach (/tmp/qf-shared-*), holding a cache that every user of the machine shares:
    cache/quantfactory/envs is writable by all and sticky, as /tmp is."""
    shared = Path(tempfile.mkdtemp(prefix="qf-shared-", dir="/tmp"))
    shared.chmod(0o755)
    envs = shared / "cache" / "quantfactory" / "envs"
    envs.mkdir(parents=True)
    envs.chmod(0o1777)
    yield shared
    shutil.rmtree(shared)


def _ensure(environment: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", ENSURE], env=environment, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _qf_run(tiny, home: Path, environment: dict, **popen) -> subprocess.Popen:
    """A real `qf run --awqct` on the tiny Llama, its units two at a time (each in a thread of its own)."""
    environment = {k: v for k, v in environment.items() if not k.startswith("FACTORY_")}
    return subprocess.Popen(
        [sys.executable, "-m", "factory.cli", "run", str(tiny), "--awqct", "--eval-windows", "2", "--max-units", "2"],
        env={**environment, "FACTORY_HOME": str(home), "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def test_a_packages_folder_another_user_planted_never_runs(tiny, shared, tmp_path):
    """Another user makes the packages' folder in the shared cache first, with a `.complete` marker and a
    `sitecustomize.py`; root's `qf run --awqct` fails with one sentence, and nothing of that folder ran as root."""
    envs, ran = shared / "cache" / "quantfactory" / "envs", shared / "ran-as"
    planted = envs / env.folder().name
    hostile_user.run(
        f"mkdir {planted}; printf '%s\\n' {' '.join(env.PINS)} > {planted}/.complete; "
        f"echo \"import os; open('{ran}', 'w').write(str(os.getuid()))\" > {planted}/sitecustomize.py; "
        f"chmod -R a+rX {planted}"
    )
    planted_files = {p.name: p.read_bytes() for p in planted.iterdir()}
    run = _qf_run(tiny, tmp_path / "home", fake_index.pip_env(shared / "cache"))
    _, stderr = run.communicate(timeout=300)
    assert not ran.exists(), f"the planted sitecustomize.py ran as uid {ran.read_text()}"
    assert run.returncode == 1, stderr[-3000:]
    assert (
        f"AWQ-CT's packages folder {planted} belongs to uid {hostile_user.uid()}, not to this user (uid 0), so it "
        "was not used: its owner could have put anything in it; remove it, or set XDG_CACHE_HOME to a folder of "
        "your own"
    ) in stderr
    assert {p.name: p.read_bytes() for p in planted.iterdir()} == planted_files  # theirs: neither used nor removed


@pytest.mark.parametrize("layout", ["lock-linked-to-a-victim", "their-folder-on-the-way", "a-writable-folder"])
def test_a_cache_others_can_change_is_refused_before_anything_is_written(layout, shared, tmp_path):
    """The install's lock, planted as a link to root's file, is not followed (the file was truncated); a folder on
    the way that another user owns, or that anyone can write (not sticky), is refused: another user could swap what
    the engine runs. One sentence, exit 1, the victim's file as it was, nothing installed."""
    cache, victim = shared / "cache", shared / "victim.txt"
    victim.write_text("root's own file")
    envs = cache / "quantfactory" / "envs"
    lock = envs / f"{env.folder().name}.lock"
    if layout == "lock-linked-to-a-victim":
        hostile_user.run(f"ln -s {victim} {lock}")
        said = f"AWQ-CT's install lock {lock} is a link; it was not used: remove it"
    elif layout == "their-folder-on-the-way":
        shutil.rmtree(cache / "quantfactory")
        cache.chmod(0o1777)
        hostile_user.run(f"mkdir -p {envs}; chmod 755 {cache / 'quantfactory'} {envs}")
        said = f"{cache / 'quantfactory'} belongs to uid {hostile_user.uid()}, so another user could change what"
    else:
        envs.chmod(0o777)
        said = f"{envs} is writable by others, so another user could change what"
    done = _ensure(fake_index.pip_env(cache, fake_index.wheels(tmp_path / "wheels")))
    assert done.returncode == 1 and said in done.stdout, done.stdout + done.stderr[-2000:]
    assert done.stdout.count("\n") == 1 and victim.read_text() == "root's own file"
    assert not (envs / env.folder().name).exists()


def _pip_under(envs: Path) -> int | None:
    """The pid of a pip installing into a temporary folder in `envs`, if one runs."""
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pip" in args and any(a.startswith(f"{envs}/.".encode()) for a in args):
            return int(proc.name)
    return None


def _sigterm_once_pip_waits(proc: subprocess.Popen, envs: Path, timeout: float, settle: float = 0):
    """SIGTERM to `proc` once (and `settle` seconds after) a pip of it installs into `envs`: (pip's pid, the seconds
    `proc` took to end, its stderr)."""
    deadline = time.monotonic() + timeout
    while (pip := _pip_under(envs)) is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    time.sleep(settle)
    proc.send_signal(signal.SIGTERM)
    stopped = time.monotonic()
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return pip, time.monotonic() - stopped, stderr


def test_sigterm_stops_qf_run_while_pip_waits_on_an_index_that_never_answers(tiny, tmp_path):
    """`qf run --awqct` with a fresh cache and a package index that accepts connections and never answers: SIGTERM
    while pip waits ends the run within seconds, pip with it, and leaves no half-made folder (it ran on for minutes)."""
    cache = tmp_path / "cache"
    envs = cache / "quantfactory" / "envs"
    with fake_index.silent_index() as index:
        run = _qf_run(tiny, tmp_path / "home", fake_index.pip_env(cache, index=index))
        pip, took, stderr = _sigterm_once_pip_waits(run, envs, 180, settle=1)
    assert took < 30, f"qf run took {took:.1f} s to stop"  # seconds, not the minutes pip waited (10.6 s at load)
    assert run.returncode == 130 and stderr.splitlines()[-1] == "interrupted", stderr[-3000:]
    assert not Path(f"/proc/{pip}").exists() or "zombie" in Path(f"/proc/{pip}/status").read_text()
    assert [p.name for p in envs.iterdir()] == [f"{env.folder().name}.lock"]


def test_sigterm_stops_the_installers_own_process(tmp_path):
    """A process that only installs the packages (scripts/setup's `python -c`), pip waiting on the silent index:
    SIGTERM ends it within seconds, pip with it, and the half-made folder goes."""
    cache = tmp_path / "cache"
    envs = cache / "quantfactory" / "envs"
    with fake_index.silent_index() as index:
        installer = subprocess.Popen(
            [sys.executable, "-c", ENSURE],
            env=fake_index.pip_env(cache, index=index),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        pip, took, stderr = _sigterm_once_pip_waits(installer, envs, 60)
    assert took < 10 and installer.returncode != 0 and "KeyboardInterrupt" in stderr, (took, stderr[-2000:])
    assert not Path(f"/proc/{pip}").exists() or "zombie" in Path(f"/proc/{pip}/status").read_text()
    assert [p.name for p in envs.iterdir()] == [f"{env.folder().name}.lock"]


def test_an_install_that_outlasts_its_time_ends_with_one_sentence(tmp_path):
    """The same silent index, FACTORY_AWQCT_INSTALL_SECONDS=2: the install ends after its 2 s with one sentence."""
    cache = tmp_path / "cache"
    with fake_index.silent_index() as index:
        start = time.monotonic()
        done = _ensure({**fake_index.pip_env(cache, index=index), "FACTORY_AWQCT_INSTALL_SECONDS": "2"}, timeout=60)
        took = time.monotonic() - start
    target = cache / "quantfactory" / "envs" / env.folder().name
    assert done.returncode == 1 and took < 20, (took, done.stdout, done.stderr[-2000:])
    assert done.stdout == (
        f"AWQ-CT's packages ({', '.join(env.PINS)}) were not installed into {target} within 2 s "
        "(FACTORY_AWQCT_INSTALL_SECONDS): pip was stopped; check that its package index answers (PIP_INDEX_URL, or "
        "PIP_NO_INDEX=1 with PIP_FIND_LINKS)\n"
    )
    assert [p.name for p in target.parent.iterdir()] == [f"{target.name}.lock"]


def test_a_half_installed_folder_is_installed_again_or_explained(tmp_path, monkeypatch):
    """A folder whose transformers lost its files (a copy killed half-way, a disk cleaner) and that gained a
    `sitecustomize.py` still has its `.complete`: the next job installs it again into a new folder that replaces it
    (before, every job took the factory's own transformers, or failed with ModuleNotFoundError). Where that
    cannot be done (no index), the job fails saying what was wrong with the folder."""
    wheels = fake_index.wheels(tmp_path / "wheels")
    for key, value in fake_index.pip_env(tmp_path / "cache", wheels).items():
        monkeypatch.setenv(key, value)
    target = env.ensure()
    transformers = "import transformers; print(transformers.__version__, getattr(transformers, 'STAND_IN', False))"

    def child_imports() -> str:
        done = subprocess.run(
            [sys.executable, "-c", transformers],
            env={**os.environ, **env.child_path()},
            capture_output=True,
            text=True,
            timeout=120,
        )
        return done.stdout.strip()

    assert child_imports() == "5.17.0 True"
    (target / "transformers" / "__init__.py").unlink()
    (target / "sitecustomize.py").write_text("print('planted')\n")
    first = target.stat().st_ino
    assert child_imports() == "5.17.0 True" and target.stat().st_ino != first
    assert not (target / "sitecustomize.py").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name, f"{target.name}.lock"]

    (target / "transformers" / "__init__.py").unlink()
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    with pytest.raises(JobFailed) as e:
        env.ensure()
    assert e.value.message.startswith(
        f"AWQ-CT could not install its packages ({', '.join(env.PINS)}) into {target}: the folder there was damaged "
        "(it is half-installed: 1 of its files are missing (transformers/__init__.py, ...)) and "
    ), e.value.message
