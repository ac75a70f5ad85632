"""`python -m tpudist.xla_dist`: run one program on every host of a slice, a cluster or this machine.

    python -m tpudist.xla_dist --tpu=$TPU_NAME --conda-env=torch-xla-1.6 --env ANY_ENV_VAR=VALUE \\
        -- python /path/to/your/code.py --train_arg1 --train_arg2

Exit status: the root cause's exit code (128+N for signal N) when a process fails, 130 after Ctrl-C,
2 for a bad command line, 255 when a host cannot be reached. See docs/launcher.md.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

PROG = "python -m tpudist.xla_dist"


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    from tpudist.launch._build import build, dry_run
    from tpudist.launch._startup import Interrupted, LaunchError
    from tpudist.launch.args import parse_args
    from tpudist.launch.supervisor import Supervisor

    try:
        config = parse_args(sys.argv[1:] if argv is None else argv, prog)     # parse
        cluster = build(config)                                               # build
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if config.job.dry_run:
        return dry_run(config, cluster)
    supervisor = Supervisor(config, cluster)
    try:
        return supervisor.run()                                               # run
    except LaunchError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 255
    except ValueError as e:  # e.g. a TPU layout that does not fit, found once the hosts answered
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except Interrupted:
        return 128 + supervisor.interrupts[0]
    finally:
        supervisor.close()                                                    # close


def exit_now(code: int) -> None:
    """Ends the launcher once the job is over and everything is closed.

    Skips the interpreter's teardown: collecting paramiko's and gRPC's objects took most of a second
    at 64 hosts, after every process and connection was already gone.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
