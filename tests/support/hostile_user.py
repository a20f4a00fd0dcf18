"""A second local user for attacks across users: the tests run as root (the victim), the attacker as this uid."""

from __future__ import annotations

import os
import pwd
import subprocess

NAME = "qf-attacker"


def uid() -> int:
    """The attacker's uid, the user made first where it does not exist (useradd; exit 9: another test made it)."""
    assert os.getuid() == 0, "attacks across users need a second uid: run the tests as root"
    try:
        return pwd.getpwnam(NAME).pw_uid
    except KeyError:
        done = subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", NAME], capture_output=True
        )
        assert done.returncode in (0, 9), done.stderr
        return pwd.getpwnam(NAME).pw_uid


def run(script: str) -> None:
    """A shell script run as the attacker."""
    attacker = uid()
    done = subprocess.run(
        ["sh", "-ec", script],
        user=attacker,
        group=pwd.getpwuid(attacker).pw_gid,
        capture_output=True,
        text=True,
        cwd="/",
    )
    assert done.returncode == 0, done.stderr
