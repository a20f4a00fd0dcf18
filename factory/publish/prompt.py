"""The prompt example of a model card: the source's chat template applied to a short conversation.

A chat template is code from the source (Jinja), and jinja2's sandbox keeps it from reaching anything but does not
bound its loops: 80 bytes of two nested `range(99999)` loops ran for 272 s inside the publish step and ignored
SIGTERM. So the template runs in a child process of its own (`python -I`, an empty environment) that is killed after
SECONDS of wall time, may use at most MEMORY bytes of address space and CPU time for SECONDS, and whose output stops
at MAX_BYTES. Whatever goes wrong, the card goes without the example and says why in one line; the publish goes on
(tests/integration/test_publish_safety.py). A template the sandbox cannot render (it needs variables beyond
transformers' usual ones, or raises) gets no example either: the card shows only what the template rendered.
"""

from __future__ import annotations

import logging
import re
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

SECONDS = 5.0
MAX_BYTES = 64 << 10
MEMORY = 512 << 20
EXAMPLE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
]
# a vision-language model's: the user's message holds an image, which the template writes as its placeholder
IMAGE_EXAMPLE = [
    {"role": "system", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in this picture?"}]},
]
TOO_LONG, NOT_RENDERED, OUT_OF_MEMORY = 3, 4, 5  # the child's exit codes besides 0
log = logging.getLogger("quantfactory")
# this very module, wherever it was imported from (-I: no environment, no current folder, no user site)
CHILD = (
    f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r}); "
    "from factory.publish.prompt import _child; _child()"
)


@dataclass(frozen=True)
class Example:
    """The rendered example, or None and why there is none."""

    text: str | None
    why_not: str | None = None


def example(template: str, image: bool = False) -> Example:
    """The template applied to EXAMPLE, or to IMAGE_EXAMPLE with `image` (a vision-language model's)."""
    try:
        done = subprocess.run(
            [sys.executable, "-I", "-c", CHILD, *(["image"] if image else [])],
            input=template.encode(),
            capture_output=True,
            timeout=SECONDS,
            env={},
        )
    except subprocess.TimeoutExpired:  # subprocess.run has killed it (SIGKILL)
        return _none(f"rendering it took longer than {SECONDS:g} s")
    if done.returncode == 0:
        return Example(done.stdout.decode("utf-8", errors="replace"))
    if done.returncode == NOT_RENDERED:
        error = done.stdout.decode("ascii", errors="replace")
        named = f" ({error})" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,79}", error) else ""
        return _none(f"jinja2's sandbox cannot render it{named}")
    why = {
        TOO_LONG: f"it renders to more than {MAX_BYTES >> 10} KiB",
        OUT_OF_MEMORY: f"rendering it needed more than {MEMORY >> 20} MiB",
    }.get(done.returncode)
    return _none(why or f"rendering it failed (exit {done.returncode})")


def _none(why: str) -> Example:
    log.warning("the model card shows no prompt example: %s", why)
    return Example(None, why)


def _render(template: str, messages: list[dict] = EXAMPLE) -> bytes:
    """In the child: the example, at most MAX_BYTES (SystemExit with TOO_LONG beyond)."""

    def raise_exception(message: str):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    out, size = [], 0
    for piece in env.from_string(template).generate(
        messages=messages, add_generation_prompt=True, bos_token="", eos_token=""
    ):
        data = piece.encode("utf-8", errors="replace")
        size += len(data)
        if size > MAX_BYTES:
            raise SystemExit(TOO_LONG)
        out.append(data)
    return b"".join(out)


def _child() -> None:
    seconds = int(SECONDS) + 1
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))
    resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds))  # a second bound, should the parent be gone
    template = sys.stdin.buffer.read().decode("utf-8", errors="replace")
    try:
        out = _render(template, IMAGE_EXAMPLE if sys.argv[1:] == ["image"] else EXAMPLE)
    except MemoryError:
        raise SystemExit(OUT_OF_MEMORY) from None
    except Exception as e:  # a template that needs more than transformers' usual variables, or raises
        sys.stdout.write(type(e).__name__)  # the error's kind only: its words are the template's
        raise SystemExit(NOT_RENDERED) from None
    sys.stdout.buffer.write(out)
