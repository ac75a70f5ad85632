"""The user's variables for every process: `--env NAME=VALUE`, `--env NAME`, `--env-file FILE`.

A value given as `--env NAME=VALUE` sits in the launcher's command line, which every user of the
machine can read (`ps`); `--env NAME` (the launcher's own value) and `--env-file` keep it out. Values
whose names look secret (`looks_secret`) are never printed: `--dry-run` shows `MASKED` in their
place, and no message here quotes any value.

    env = parse_env(["A=1", "HF_TOKEN"], files=[".env"], environ=os.environ)
    shown = masked(env)          # {"A": "1", "HF_TOKEN": "<hidden>", ...}
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL")
MASKED = "<hidden>"


def looks_secret(name: str) -> bool:
    """Whether a variable's name says its value is a secret: it contains KEY, TOKEN, SECRET,
    PASSWORD, PASSWD or CREDENTIAL, in any case (`WANDB_API_KEY`, `hf_token`)."""
    upper = name.upper()
    return any(word in upper for word in SECRET_WORDS)


def masked(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the value of every secret-looking name replaced by MASKED."""
    return {k: MASKED if looks_secret(k) else v for k, v in env.items()}


def _check_name(name: str, where: str, reserved: Collection[str]) -> None:
    if not _NAME_RE.match(name):
        words = name.split(None, 1)  # `NAME value`: the value stays unsaid
        shown = words[0] + " ..." if len(words) > 1 else name
        raise ValueError(f"{where}: {shown!r} is not a valid variable name (letters, digits and _, "
                         "not starting with a digit; write NAME=VALUE)")
    if name in reserved:
        raise ValueError(f"{where}: {name} is set by the launcher for each process and cannot be overridden")


def _own_value(name: str, where: str, environ: Mapping[str, str]) -> str:
    if name not in environ:
        raise ValueError(f"{where}: {name} is not set in the launcher's environment; export it "
                         f"first, or give a value ({name}=VALUE in an --env-file)")
    return environ[name]


def parse_env_file(path: str, environ: Mapping[str, str], reserved: Collection[str] = ()) -> dict[str, str]:
    """An --env-file: `NAME=VALUE` lines (`export ` before the name allowed), `NAME` alone for the
    launcher's own value, `#` comments and blank lines. The value is the rest of the line, one
    pair of matching outer quotes removed; nothing else is interpreted ($, \\)."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"--env-file {path}: cannot read it ({e.strerror})") from None
    env: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        where = f"--env-file {path} line {number}"
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("export "):
            text = text[len("export "):].lstrip()
        name, sep, value = text.partition("=")
        name = name.strip()
        _check_name(name, where, reserved)
        if not sep:
            env[name] = _own_value(name, where, environ)
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        env[name] = value
    return env


def parse_env(values: Sequence[str], files: Sequence[str] = (), environ: Mapping[str, str] | None = None,
              reserved: Collection[str] = ()) -> dict[str, str]:
    """Every process's extra variables: the --env-file files in order, then the --env values in order
    (a later one wins). `NAME=VALUE` keeps VALUE byte for byte; `NAME` takes the launcher's value.
    A name in `reserved` (the launcher's own variables) is refused."""
    import os

    environ = os.environ if environ is None else environ
    env: dict[str, str] = {}
    for path in files:
        env.update(parse_env_file(path, environ, reserved))
    for item in values:
        name, sep, value = item.partition("=")
        where = "--env"
        _check_name(name, where, reserved)
        env[name] = value if sep else _own_value(name, where, environ)
    return env


def secrets_in_argv(values: Sequence[str]) -> list[str]:
    """The secret-looking names given as --env NAME=VALUE (their values are in the launcher's argv)."""
    return [item.partition("=")[0] for item in values if "=" in item and looks_secret(item.partition("=")[0])]
