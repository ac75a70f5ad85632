"""Job sources: where a process learns which job it is in, for `tpudist.init()`.

A job source is a small stateless class that registers itself by subclassing `JobSource` (as the
launcher's cluster sources do, tpudist/launch/clusters). `init()` asks each, in `priority` order,
whether it applies to the process's environment (`applies`: a yes or no with the reason, which is
logged), and the first that does describes the job (`job`). Sources:

- `launcher`: the contract the launcher and `tpudist.spawn` write (tpudist/contract.py).
- `gke`: a TPU slice that GKE / JobSet started, with no launcher (tpudist/_gke.py).
- `single`: nothing set, one process on this machine.

    job = detect(os.environ)   # a contract.JobEnv
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Mapping
from typing import ClassVar

from tpudist import contract

log = logging.getLogger("tpudist")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A source's answer to "does this environment describe your kind of job?", and why."""

    applies: bool
    reason: str


class JobSource:
    """Base of every job source. Subclasses register themselves by name."""

    name: ClassVar[str] = ""
    priority: ClassVar[int] = 100  # lower is asked first
    registry: ClassVar[dict[str, type["JobSource"]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.name:
            raise TypeError(f"job source {cls.__qualname__} must set a name")
        JobSource.registry[cls.name] = cls

    @classmethod
    def applies(cls, environ: Mapping[str, str]) -> Verdict:
        raise NotImplementedError

    @classmethod
    def job(cls, environ: Mapping[str, str]) -> contract.JobEnv:
        """This process's job. Raises ValueError naming the variable, its value and the fix."""
        raise NotImplementedError


_LAUNCHER_NAMES = (contract.COORDINATOR, contract.WORLD_SIZE, contract.RANK)


class LauncherSource(JobSource):
    """The launcher's (or `tpudist.spawn`'s) contract: any of its identity variables set."""

    name = "launcher"
    priority = 0

    @classmethod
    def applies(cls, environ: Mapping[str, str]) -> Verdict:
        found = [f"{n}={environ[n]}" for n in _LAUNCHER_NAMES if environ.get(n)]
        if found:
            return Verdict(True, f"the launcher's contract is set ({', '.join(found)})")
        return Verdict(False, f"none of {', '.join(_LAUNCHER_NAMES)} is set")

    @classmethod
    def job(cls, environ: Mapping[str, str]) -> contract.JobEnv:
        return contract.JobEnv.from_environ(environ)


class SingleSource(JobSource):
    """Nothing describes a job: one process on this machine (asked last)."""

    name = "single"
    priority = 1000

    @classmethod
    def applies(cls, environ: Mapping[str, str]) -> Verdict:
        return Verdict(True, "no other source applies: a single-process job on this machine")

    @classmethod
    def job(cls, environ: Mapping[str, str]) -> contract.JobEnv:
        return contract.JobEnv.from_environ(environ)


SOURCE_MODULES = ("tpudist._gke",)


def sources() -> list[type[JobSource]]:
    """Registered sources in the order they are asked."""
    for module in SOURCE_MODULES:
        importlib.import_module(module)
    return sorted(JobSource.registry.values(), key=lambda s: (s.priority, s.name))


def verdicts(environ: Mapping[str, str]) -> list[tuple[str, Verdict]]:
    """Every source's verdict on `environ`."""
    return [(source.name, source.applies(environ)) for source in sources()]


def detect(environ: Mapping[str, str]) -> contract.JobEnv:
    """The job the first applicable source describes; logs why it applied and why others did not."""
    for source in sources():
        verdict = source.applies(environ)
        if verdict.applies:
            log.info("job source %s: %s", source.name, verdict.reason)
            return source.job(environ)
        log.debug("job source %s does not apply: %s", source.name, verdict.reason)
    raise AssertionError("the single source always applies")
