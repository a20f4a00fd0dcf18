"""Settings read from the environment, in one place.

FACTORY_HOME      where the catalog, registry folder, work folders and caches live
                  (default $XDG_DATA_HOME/quantfactory, else ~/.local/share/quantfactory)
FACTORY_DB_URL    the catalog's SQLAlchemy URL (default sqlite:///$FACTORY_HOME/catalog.db)
FACTORY_BROKER_URL  the Celery broker and result backend for `qf submit` and workers (default
                  redis://127.0.0.1:6379/0)
FACTORY_VISIBILITY_TIMEOUT  seconds Redis waits before handing an unacknowledged job to another worker; longer
                  than the longest job (default 43200)
FACTORY_WORKER_DEVICE  the device `qf submit`, the service and the watchlist plan a job for, and so its queue
                  (DEVICE_QUEUES: a CUDA job goes to the `gpu` queue, a CPU job to `cpu`): auto (default: CUDA
                  when one of the job's engines needs it, EXL2 or EXL3, else the CPU, so an AWQ-only job runs on
                  any worker that takes the cpu queue, with the CPU's evaluation protocol; workers/tasks.py), cuda
                  (GPU workers run every job) or cpu (CPU workers only: engines that need CUDA are refused at submit)
FACTORY_LEASE_SECONDS  how long a running job's lease lasts without a heartbeat (default 120; renewed every third)
FACTORY_STALL_SECONDS  how long a job may go without progress (an event: a step, a layer, a window) before its
                  holder stops renewing the lease and kills it, so that it continues elsewhere (default 1800: the
                  longest silence seen is a model load or a calibration pass of a few minutes)
FACTORY_RECONCILE_SECONDS  how often beat looks for lost workers and lost messages (default 60)
FACTORY_WATCH_SECONDS  how often beat asks the Hub about the watchlist (default 3600)
FACTORY_MAX_ATTEMPTS  how often a job may be taken again after its holder was lost (an expired lease) before it
                  fails as lost, the first take included (default 3); the hand-off to the publishing step is not one
FACTORY_MAX_UNITS  how many units of a job (a conversion, an evaluation, ...) one machine runs at once, while
                  their predicted GPU memory and CPU cores fit (default: as many as fit; 1: one after another);
                  `qf run --max-units` and `qf worker --max-units` set it
FACTORY_HUB_OWNER  publish every quant to the Hugging Face Hub under this user or organization as well (default:
                  the registry folder only); the token is HF_TOKEN or huggingface_hub's stored login
FACTORY_HUB_<ENGINE>_REPO  an engine's repo name template on the Hub (default: the engine's `hub_repo`, e.g.
                  `{owner}/{model}-<engine>`; {model} is the factory's name of the model); `qf pull` uses them too
FACTORY_SERVER    the URL of a factory's service (`qf serve`): the CLI then submits, follows and pulls through it
                  instead of the catalog and broker; `--server URL` sets it for one command
FACTORY_TOKEN     the bearer token the CLI sends to FACTORY_SERVER (`qf token create` prints one)
FACTORY_SERVE_SOURCES  folders (separated by ":") whose model folders a service's users may name as a source; Hub
                  repos are always allowed (default: none, Hub repos only)
FACTORY_SERVE_PUBLIC  1: the service's dashboard and its read-only pages need no token (default: a token)
OMP_NUM_THREADS   the threads torch's CPU kernels take in each process (the factory's and its engines' children):
                  what a unit on the CPU keeps busy, so that units pack beside each other when it is below the
                  machine's cores (default: all of them)
FACTORY_GGUF_SPLIT_BYTES  the largest GGUF file the factory publishes: a quant's file over it is cut by llama.cpp's
                  gguf-split into parts of at most this many bytes of tensors, each with its metadata (default 48e9,
                  2 GB under the Hub's 50 GB per file)
FACTORY_LLAMA_CPP_SDIST  the pinned llama-cpp-python sdist as a file, which GGUF's build of llama.cpp reads instead of
                  downloading it from PyPI (its sha256 checked either way; default: downloaded)
FACTORY_WARM_START  0 (or false, no, off): every engine child starts a fresh Python, which imports its libraries
                  itself, as before 2026-12-06 (for debugging); default 1: the engines' Python children are forked
                  from a starter that imported torch and transformers once per process (factory/engines/warm.py)
FACTORY_PLACE_SECONDS  how long a submission to the service may hold its place in its user's quota before the
                  place is let go (a server killed mid-submission; default 900)
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from factory.errors import SpecError, mask_url

WORKER_DEVICES = ("cuda", "cpu", "auto")
DEVICE_QUEUES = {"cuda": "gpu", "cpu": "cpu"}  # the queue a job planned for the device goes to (workers/tasks.py)
WORKERS_KEY = "quantfactory:workers:"  # + queue: the workers taking it (a Redis sorted set, scored by their beat)
WORKER_BEAT_SECONDS = 10.0  # how often a worker says it is up; one silent for 3 beats is taken to be down
POSTGRES_URL = re.compile(r"^postgres(ql)?(\+psycopg2)?://")  # the URL forms users and SQLAlchemy write
HUB_REPO_VARIABLE = re.compile(r"FACTORY_HUB_([A-Z0-9]+)_REPO")


@dataclass(frozen=True)
class Settings:  # a plain dataclass: `qf status` must start fast, and pydantic's import alone costs 0.2 s
    home: Path
    db_url: str
    broker_url: str = "redis://127.0.0.1:6379/0"
    visibility_timeout: int = 43200
    worker_device: str = "auto"
    lease_seconds: float = 120.0
    max_attempts: int = 3
    stall_seconds: float = 1800.0
    reconcile_seconds: float = 60.0
    watch_seconds: float = 3600.0
    hub_owner: str | None = None
    max_units: int | None = None  # units of a job run at once on this machine; None: as many as fit
    gpu_ledger: Path | None = None  # the units of every job on this GPU and its cores (qf worker's slots share it)
    hub_repos: dict[str, str] = field(default_factory=dict)  # engine name -> repo template, where one is set
    server: str | None = None  # the service the CLI talks to instead of the catalog and broker
    token: str | None = None
    serve_sources: tuple[Path, ...] = ()  # folders the service lets its users name sources in
    serve_public: bool = False  # the dashboard readable without a token
    place_seconds: float = 900.0  # how long a submission in progress holds its place in its user's quota

    @property
    def registry(self) -> Path:
        return self.home / "registry"

    @property
    def work(self) -> Path:
        return self.home / "work"

    @property
    def measurements(self) -> Path:
        """Engines' measurements, one file per measurement key (see identity.measurement_key)."""
        return self.home / "measurements"

    @property
    def references(self) -> Path:
        """FP16's compact next-token distributions, one file per eval stream (identity.reference_key)."""
        return self.home / "references"

    @property
    def texts(self) -> Path:
        """Calibration and eval files that `qf calib ls` lists (name them with file:<path>)."""
        return self.home / "texts"

    @property
    def cache(self) -> Path:
        return self.home / "cache"


_FROM_ENV = {  # field -> (variable, type); an unset or empty variable leaves the field's default
    "broker_url": ("FACTORY_BROKER_URL", str),
    "visibility_timeout": ("FACTORY_VISIBILITY_TIMEOUT", int),
    "worker_device": ("FACTORY_WORKER_DEVICE", lambda v: _one_of("FACTORY_WORKER_DEVICE", v, WORKER_DEVICES)),
    "lease_seconds": ("FACTORY_LEASE_SECONDS", float),
    "max_attempts": ("FACTORY_MAX_ATTEMPTS", int),
    "stall_seconds": ("FACTORY_STALL_SECONDS", float),
    "reconcile_seconds": ("FACTORY_RECONCILE_SECONDS", float),
    "watch_seconds": ("FACTORY_WATCH_SECONDS", float),
    "hub_owner": ("FACTORY_HUB_OWNER", str),
    "max_units": ("FACTORY_MAX_UNITS", int),
    "gpu_ledger": ("FACTORY_GPU_LEDGER", Path),
    "server": ("FACTORY_SERVER", str),
    "token": ("FACTORY_TOKEN", str),
    "serve_sources": ("FACTORY_SERVE_SOURCES", lambda v: tuple(Path(p).resolve() for p in v.split(":") if p)),
    "serve_public": ("FACTORY_SERVE_PUBLIC", lambda v: v.lower() in ("1", "true", "yes")),
    "place_seconds": ("FACTORY_PLACE_SECONDS", float),
}


def load() -> Settings:
    env_home = os.environ.get("FACTORY_HOME")
    if env_home:
        home = Path(env_home)
    else:
        data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        home = Path(data) / "quantfactory"
    try:
        home = home.expanduser().resolve()
    except RuntimeError:  # ~user of a user that does not exist
        raise SpecError(f"FACTORY_HOME={str(home)!r} names the home of a user that does not exist") from None
    db_url = os.environ.get("FACTORY_DB_URL") or f"sqlite:///{home / 'catalog.db'}"
    found = {field: kind(os.environ[var]) for field, (var, kind) in _FROM_ENV.items() if os.environ.get(var)}
    repos = {m[1].lower(): v for k, v in os.environ.items() if (m := HUB_REPO_VARIABLE.fullmatch(k)) and v}
    return Settings(home=home, db_url=db_url, hub_repos=repos, **found)


def _one_of(variable: str, value: str, allowed: tuple[str, ...]) -> str:
    if value.lower() not in allowed:
        raise SpecError(f"{variable}={value!r} is not one of {', '.join(allowed)}")
    return value.lower()


def cpu_threads() -> int:
    """The cores one process's torch keeps busy on the CPU: OMP_NUM_THREADS where it is set (and below the
    machine's cores), else every core."""
    cores = os.cpu_count() or 1
    value = os.environ.get("OMP_NUM_THREADS", "")
    return min(int(value), cores) if value.isdigit() and int(value) > 0 else cores


def warm_start() -> bool:
    """FACTORY_WARM_START: anything but 0, false, no or off (any case) is on; unset is on."""
    return os.environ.get("FACTORY_WARM_START", "").strip().lower() not in ("0", "false", "no", "off")


def llama_cpp_sdist() -> Path | None:
    """FACTORY_LLAMA_CPP_SDIST: the pinned llama-cpp-python sdist as a file on this machine, which the GGUF build
    reads instead of downloading it (for machines without PyPI); unset: downloaded."""
    value = os.environ.get("FACTORY_LLAMA_CPP_SDIST", "").strip()
    return Path(value) if value else None


GGUF_SPLIT_BYTES = 48 * 10**9


def gguf_split_bytes() -> int:
    """FACTORY_GGUF_SPLIT_BYTES: bytes, a whole number of megabytes (gguf-split's unit) of at least one. Valid: 48e9,
    2000000. Not valid: 1.5e6 (not whole megabytes), 0, "48G"."""
    value = os.environ.get("FACTORY_GGUF_SPLIT_BYTES", "").strip()
    if not value:
        return GGUF_SPLIT_BYTES
    try:
        size = float(value)
    except ValueError:
        size = 0.0
    if size < 10**6 or size % 10**6:
        raise SpecError(f"FACTORY_GGUF_SPLIT_BYTES={value!r} is not a whole number of megabytes (bytes, e.g. 48e9)")
    return int(size)


def database_kind(url: str) -> str:
    """ "sqlite" or "postgresql" for the catalog URLs the factory takes; SpecError (exit 2) for any other."""
    if url.startswith("sqlite:///"):
        return "sqlite"
    if POSTGRES_URL.match(url):
        return "postgresql"
    raise SpecError(f"FACTORY_DB_URL {mask_url(url)} is neither sqlite:///PATH nor postgresql://...")
