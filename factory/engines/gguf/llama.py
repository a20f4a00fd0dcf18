"""llama.cpp at one pinned version, built once per machine and cached by version: the converter, the tools and the
inference GGUF quants are made and scored with.

The source is the PyPI sdist of llama-cpp-python (SDIST, checked by its sha256; FACTORY_LLAMA_CPP_SDIST names a copy
on a machine without PyPI), which vendors llama.cpp in
`vendor/llama.cpp`: `convert_hf_to_gguf.py` with its `gguf-py`, and the tools. The build, in
`$XDG_CACHE_HOME/quantfactory/llama.cpp/<version>-<cpu|cuda>/` (`~/.cache/...` by default; every FACTORY_HOME and
worker of the machine shares it):

    src/      the sdist, unpacked
    build/    cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DLLAMA_CURL=OFF ... (-DGGML_CUDA=ON where
              nvcc and a GPU exist), targets TOOLS and libllama; llama.cpp's `common` library, which the tools use
              only for their command lines, at -O0 (cheap_common.cmake)
    bin/qf-llama  our driver over libllama (logits.cpp): every position's logits of the token ids it is given, and
              llama.cpp's own tokenization of a text
    multimodal/   llama-mtmd-cli, llama.cpp's multimodal tool, only when first asked for (multimodal_tool; never by
              setup, so CI's minutes do not grow): a build of its own with the same flags, because build/ was
              configured in the hidden folder and cmake cannot build it again once renamed

`python -m factory.engines.gguf.build` makes it (scripts/setup runs it, so CI counts its minutes); a job never builds
it: without it a GGUF job is refused at submit with one sentence naming that command. Made under a lock, in a
hidden temporary folder renamed when complete, so concurrent builds make it once and a killed build is never taken
for a finished one (run again, it starts over).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import resources
from pathlib import Path

from factory.errors import JobFailed, SpecError
from factory.settings import llama_cpp_sdist

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
TOOLS = ("llama-quantize", "llama-imatrix", "llama-gguf-split")
MULTIMODAL = "llama-mtmd-cli"
DRIVER = "qf-llama"
DONE = ".complete"
SETUP = "python -m factory.engines.gguf.build"  # or scripts/setup, which runs it
CMAKE_FLAGS = (
    "-G",
    "Ninja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",  # the binaries find their libraries beside them once the folder is renamed
)


def flavour() -> str:
    """`cuda` where nvcc and a GPU exist (the tools and the inference then run on it), else `cpu`."""
    return "cuda" if shutil.which("nvcc") and shutil.which("nvidia-smi") else "cpu"


def folder(kind: str | None = None) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "quantfactory" / "llama.cpp" / f"{VERSION}-{kind or flavour()}"


def version() -> str:
    return f"llama.cpp of {PACKAGE} {VERSION}"


def built() -> Path:
    """The build's folder; SpecError (one sentence naming the command that makes it) where it is not made."""
    where = folder()
    if not (where / DONE).is_file():
        raise SpecError(f"GGUF needs llama.cpp built on this machine ({where} is missing); run: {SETUP}")
    return where


def tool(name: str) -> Path:
    """`llama-quantize`, `llama-imatrix`, `llama-gguf-split` or DRIVER."""
    where = built()
    return where / "bin" / DRIVER if name == DRIVER else where / "build" / "bin" / name


def multimodal_tool(log=print) -> Path:
    """llama-mtmd-cli (a language model's GGUF, its mmproj and an image in, text out), built when first asked for:
    minutes once (llama.cpp again, and the tool), then ninja finds it up to date; configured in place, so a killed
    build resumes where it stopped. Under the build's lock, so concurrent callers build it once."""
    where = built()
    out = where / "multimodal"
    with open(where.parent / f"{where.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "bin" / MULTIMODAL).is_file():
            log(f"building {MULTIMODAL} into {out} (once: minutes)")
        if not (out / "build.ninja").is_file():
            _run(["cmake", "-S", str(source()), "-B", str(out), *_configure_flags()], where, "cmake")
        jobs = str(os.cpu_count() or 2)
        _run(["cmake", "--build", str(out), "--target", MULTIMODAL, "-j", jobs], where, f"build of {MULTIMODAL}")
    return out / "bin" / MULTIMODAL


def source() -> Path:
    """The vendored llama.cpp: convert_hf_to_gguf.py and gguf-py."""
    return built() / "src" / "vendor" / "llama.cpp"


def build(log=print) -> Path:
    """The build's folder, made first if it is not there yet (minutes: see the module's docstring)."""
    target = folder()
    if (target / DONE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / DONE).is_file():  # another process made it while this one waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            start = time.monotonic()
            _make(tmp, log)
            (tmp / DONE).write_text(f"{version()}\n{flavour()}\n{time.monotonic() - start:.0f} s\n")
            shutil.rmtree(target, ignore_errors=True)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make(tmp: Path, log) -> None:
    sdist = tmp / SDIST
    if (local := llama_cpp_sdist()) is not None:
        log(f"{PACKAGE} {VERSION}'s sdist from {local} (FACTORY_LLAMA_CPP_SDIST)")
        try:
            shutil.copyfile(local, sdist)
        except OSError as e:
            raise JobFailed(f"FACTORY_LLAMA_CPP_SDIST={local} cannot be read: {e.strerror or e}") from None
    else:
        log(f"downloading {PACKAGE} {VERSION} (its sdist vendors llama.cpp)")
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(tmp)]
             + ["--disable-pip-version-check", f"{PACKAGE}=={VERSION}"], tmp, "pip download")  # fmt: skip
    if hashlib.sha256(sdist.read_bytes()).hexdigest() != SDIST_SHA256:
        raise JobFailed(f"{SDIST} does not have the pinned sha256 {SDIST_SHA256[:12]}...; refusing to build it")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp, filter="data")
    (tmp / SDIST.removesuffix(".tar.gz")).rename(tmp / "src")
    sdist.unlink()
    llama = tmp / "src" / "vendor" / "llama.cpp"
    jobs = str(os.cpu_count() or 2)
    log(f"building llama.cpp ({flavour()}; {', '.join(TOOLS)}, libllama) with {jobs} jobs: minutes")
    _run(["cmake", "-S", str(llama), "-B", str(tmp / "build"), *_configure_flags()], tmp, "cmake")
    _run(["cmake", "--build", str(tmp / "build"), "--target", *TOOLS, "llama", "-j", jobs], tmp, "the build")
    compile_driver(tmp)


def _configure_flags() -> list[str]:
    hook = Path(__file__).with_name("cheap_common.cmake")  # llama.cpp's `common` at -O0: its docstring says why
    cuda = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=native"] if flavour() == "cuda" else []
    return [*CMAKE_FLAGS, f"-DCMAKE_PROJECT_INCLUDE={hook}", *cuda]


def compile_driver(where: Path) -> Path:
    """bin/qf-llama from logits.cpp, against the build's libllama (seconds)."""
    llama, lib = where / "src" / "vendor" / "llama.cpp", where / "build" / "bin"
    (where / "bin").mkdir(exist_ok=True)
    out = where / "bin" / DRIVER
    with resources.as_file(resources.files("factory.engines.gguf") / "logits.cpp") as cpp:
        cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++17", str(cpp), "-o", str(out)]
        cmd += [
            f"-I{llama / 'include'}",
            f"-I{llama / 'ggml' / 'include'}",
            f"-L{lib}",
            "-Wl,-rpath,$ORIGIN/../build/bin",
        ]
        _run([*cmd, "-lllama", "-lggml", "-lggml-base"], where, "compiling qf-llama")
    return out


def _run(cmd: list[str], where: Path, what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    with open(where / "build.log", "a") as log:
        log.write(f"$ {' '.join(cmd)}\n{done.stdout}{done.stderr}")
    if done.returncode != 0:
        last = [ln for ln in (done.stderr or done.stdout).splitlines() if ln.strip()][-1:] or ["no output"]
        raise JobFailed(f"llama.cpp's {what} failed: {last[0][:300]} (see {where / 'build.log'})")
