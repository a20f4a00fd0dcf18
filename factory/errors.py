"""Every failure a user can act on, one class each, with the exit code the CLI returns for it.

| exit | class              | meaning                                                         |
|------|--------------------|-----------------------------------------------------------------|
| 0    |                    | ok (also: the same job again returns the existing job)          |
| 1    | JobFailed          | a step failed, or the quality gate refused a quant              |
| 2    | SpecError          | bad usage or spec: numbers, names, recipe keys, no CUDA for an engine that needs it |
| 3    | ModelRefused       | inspection refused the checkpoint                               |
| 3    | SourceChanged      | a local source's bytes are not what its job was submitted with  |
| 4    | NotFound           | a path, name or tag that does not exist                         |
| 5    | ServiceUnavailable | database, broker, Hub or the factory's service unreachable      |
| 5    | AccessDenied       | the service refused the token, its scope, or another user's job |
| 5    | OverQuota          | the service's quota for this user is used up (until it resets)  |
| 6    |                    | `qf status JOB` of a cancelled job (a failed one: 1; --json: 0) |

Messages are one sentence saying what was wrong and what is allowed; the CLI prints them as they are.
"""

from __future__ import annotations

import re


class FactoryError(Exception):
    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class JobFailed(FactoryError):
    exit_code = 1


class QualityGateRefused(JobFailed):
    """A quant the recipe's quality gate refused: its perplexity against FP16's (`max_ppl_ratio`), or its KL
    divergence from FP16 (`max_kld`)."""

    def __init__(self, tag: str, measured: str, limit: str):
        super().__init__(f"quality gate refused {tag}: {measured}, allowed at most {limit}")
        self.tag = tag

    @classmethod
    def perplexity(cls, tag: str, ppl: float, fp16_ppl: float, max_ratio: float) -> QualityGateRefused:
        return cls(
            tag, f"perplexity {ppl:.4g} vs FP16 {fp16_ppl:.4g} (ratio {ppl / fp16_ppl:.3f})", f"{max_ratio:g} x FP16"
        )

    @classmethod
    def divergence(cls, tag: str, kld: float, max_kld: float) -> QualityGateRefused:
        return cls(tag, f"KL divergence from FP16 {kld:.4g}", f"{max_kld:g} (max_kld)")


class Cancelled(JobFailed):
    """The job was cancelled (`qf cancel`) while it ran; raised at its next progress event or step."""


class LeaseLost(JobFailed):
    """Another holder took the job (this one stalled past its lease): stop, and write nothing more for it."""


class QuantRemoved(JobFailed):
    """A published quant this job reused was removed (`qf rm`) while the job evaluated or published it."""

    def __init__(self, name: str, tag: str):
        super().__init__(f"{name}:{tag} was removed while this job evaluated it; run the same command again to make it")


class SpecError(FactoryError):
    exit_code = 2


class Conflict(SpecError):
    """A request the job's state does not allow now (retrying a job that is running)."""


class ModelRefused(FactoryError):
    exit_code = 3


class SourceChanged(ModelRefused):
    """A local source's files are not what was hashed when the job was submitted: the job's snapshot of the folder
    (factory/checkpoints/files.py) hashed other bytes. `files` names those the hash cache knew otherwise."""

    def __init__(self, source: str, files: list[str], then: str):
        which = f"{', '.join(files)} {'is' if len(files) == 1 else 'are'} not" if files else "its files are not"
        super().__init__(
            f"source folder {source!r} changed since the job was submitted: {which} what was hashed then; {then}"
        )
        self.source = source
        self.files = files


class NotFound(FactoryError):
    exit_code = 4


class ServiceUnavailable(FactoryError):
    exit_code = 5


class AccessDenied(FactoryError):
    exit_code = 5


class OverQuota(AccessDenied):
    """A user's quota (`qf token create --quota-jobs-per-day`, `--max-running`) is used up."""


def mask_url(url: str) -> str:
    """A service URL as messages, logs and the catalog may show it: the password and any token, key or password in
    the query replaced by ***. Every URL the factory prints or stores passes through here."""
    url = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)
    return re.sub(r"([?&;](?:token|access_token|password|key|secret)=)[^&;#]*", r"\1***", url, flags=re.I)


_UNREACHABLE = (
    "could not connect",
    "connection refused",
    "could not translate host name",
    "timeout expired",
    "no such file or directory",
    "network is unreachable",
    "server closed the connection",
)


def database_error(url: str, error: BaseException) -> ServiceUnavailable:
    """What the database said, as one sentence: "cannot be reached" when nothing answered, else its own words
    (a role that does not exist, a wrong password, a missing database)."""
    reason = str(getattr(error, "orig", None) or error).strip().splitlines()
    first = reason[0].rsplit("FATAL:", 1)[-1].strip() if reason else type(error).__name__
    if any(word in first.lower() for word in _UNREACHABLE):
        return ServiceUnavailable(f"the catalog database at {mask_url(url)} cannot be reached")
    return ServiceUnavailable(f"the catalog database at {mask_url(url)} refused: {mask_url(first)}")
