"""The Hugging Face Hub client pieces that fetching and publishing share: the endpoint (HF_ENDPOINT), an HfApi,
the token (HF_TOKEN or huggingface_hub's stored login), errors as one sentence (`errors`), retries of 429 and 5xx
answers with backoff (`retrying`), and checksummed downloads. Tokens go nowhere else: not into task arguments, the
catalog, logs or messages. sources.py fetches with these; publish/hub.py publishes and pulls with them.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

from factory.errors import JobFailed, NotFound, ServiceUnavailable, mask_url
from factory.identity import file_sha256

RETRY_STATUS = (429, 500, 502, 503, 504)
RETRIES = 5
BACKOFF_SECONDS = float(os.environ.get("FACTORY_HUB_BACKOFF", "2"))  # first wait; doubles; Retry-After wins


def endpoint() -> str:
    from huggingface_hub import constants

    return os.environ.get("HF_ENDPOINT") or constants.ENDPOINT


def client(token: str | None = None):
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint(), token=token)


_REACHED: set[str] = set()
PROBE_SECONDS = 5


def _probe(url: str) -> None:
    """One connection to the Hub's host before the client's first call, so that an offline machine hears why in a
    second instead of after huggingface_hub's 25 s of retries; once per endpoint and process."""
    if url in _REACHED:
        return
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    where = f"the Hub at {mask_url(url)} cannot be reached"
    hint = "; set HF_ENDPOINT for another Hub, or quantize local folders"
    try:
        socket.create_connection((host, port), timeout=PROBE_SECONDS).close()
    except socket.gaierror:
        raise ServiceUnavailable(f"{where} (its name {host!r} does not resolve: offline?){hint}") from None
    except ConnectionRefusedError:
        raise ServiceUnavailable(f"{where} (port {port} of {host} refuses connections){hint}") from None
    except OSError as e:  # a timeout, no route
        raise ServiceUnavailable(f"{where} ({e.strerror or 'no answer'}){hint}") from None
    _REACHED.add(url)


@contextmanager
def errors(what: str) -> Iterator[None]:
    """The client's exceptions as one sentence each: missing or gated -> exit 4, unreachable or refused -> 5, an
    answer nested too deeply to parse -> 1 (as the factory's service's, factory/service/client.py)."""
    import httpx2

    _probe(endpoint())
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        yield
    except GatedRepoError:
        raise NotFound(
            f"{what} is gated and this token has no access; accept its terms on the Hub, or use a "
            "token (HF_TOKEN) that has"
        ) from None
    except RevisionNotFoundError:
        raise NotFound(f"{what}: the Hub has no such revision") from None
    except RepositoryNotFoundError:
        raise NotFound(f"{what} does not exist on the Hub (or is private to another account)") from None
    except LocalEntryNotFoundError:  # the client's word for a download it could not make (network, 5xx)
        raise ServiceUnavailable(f"the Hub at {mask_url(endpoint())} cannot be reached") from None
    except EntryNotFoundError:
        raise NotFound(f"{what}: a file the Hub listed is missing") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        if status == 401:
            raise ServiceUnavailable("the Hub rejected the token (HF_TOKEN or the stored login)") from None
        if status == 403:
            raise ServiceUnavailable(f"the Hub refused this token access to {what}") from None
        raise ServiceUnavailable(f"the Hub at {mask_url(endpoint())} answered {status} for {what}") from None
    except (httpx2.TransportError, ConnectionError, TimeoutError):
        raise ServiceUnavailable(f"the Hub at {mask_url(endpoint())} cannot be reached") from None
    except RecursionError:  # the client's json parsing of an answer nested thousands deep
        raise JobFailed(
            f"the Hub at {mask_url(endpoint())} answered for {what} with JSON nested too deeply to be read"
        ) from None


def status(e: Exception) -> int | None:
    response = getattr(e, "response", None)
    return response.status_code if response is not None else None


def retrying(call: Callable[[], object]):
    """`call()`, again after a 429 or 5xx answer (Retry-After respected, else backoff doubling), RETRIES times."""
    from huggingface_hub.errors import HfHubHTTPError

    for attempt in range(RETRIES):
        try:
            return call()
        except HfHubHTTPError as e:
            if status(e) not in RETRY_STATUS or attempt == RETRIES - 1:
                raise
            wait = e.response.headers.get("Retry-After")
            time.sleep(min(float(wait) if wait else BACKOFF_SECONDS * 2**attempt, 60))
    raise AssertionError("unreachable")


def remote_id(sibling) -> str:
    return sibling.lfs.sha256 if sibling.lfs is not None else sibling.blob_id


def file_id(path: Path, lfs: bool) -> str:
    """What the Hub names a file by: its sha256 when it is stored in LFS, else its git blob sha1."""
    if lfs:
        return file_sha256(path)
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def download(repo: str, sibling, revision: str, folder: Path) -> Path:
    """One file (`sibling`, from model_info with files_metadata) of `repo` at `revision` into `folder`, checked
    against the Hub's sha256 (LFS) or git blob id; a file that does not match is deleted (JobFailed)."""
    from huggingface_hub import hf_hub_download

    path = Path(
        retrying(
            lambda: hf_hub_download(
                repo, sibling.rfilename, revision=revision, local_dir=folder, endpoint=endpoint(), token=token()
            )
        )
    )
    if file_id(path, lfs=sibling.lfs is not None) != remote_id(sibling):
        path.unlink()
        raise JobFailed(f"{repo}@{revision[:7]}: {sibling.rfilename} does not match the Hub's checksum; deleted")
    return path


def config_file(repo: str, revision: str) -> Path:
    """config.json of `repo` at `revision`, through huggingface_hub's cache (read it with inspection.read_config)."""
    from huggingface_hub import hf_hub_download

    return Path(
        retrying(lambda: hf_hub_download(repo, "config.json", revision=revision, endpoint=endpoint(), token=token()))
    )


def token() -> str | None:
    """HF_TOKEN, else the login huggingface_hub stored (`hf auth login`)."""
    from huggingface_hub import get_token

    return os.environ.get("HF_TOKEN") or get_token()
