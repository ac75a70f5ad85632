"""The control plane between the launcher and its per-host agents: what both ends share.

The protocol is `control.proto` (generated: `control_pb2`, `control_pb2_grpc`; regenerate with
`scripts/gen_proto`). The launcher's end, the gRPC server, is `_server.py`; the agent's end is
`tpudist.launch.agent`. Both import this module for the few facts they must agree on: the
metadata key that carries the job token, the message size limit, and the bootstrap line the
launcher writes to an agent's stdin (base64 JSON: control port, job token, worker index), so that
nothing secret or user-given is on a command line.

    line = Bootstrap(worker=0, host="10.0.0.2", port=4711, token="...", die_with_parent=True).encode()
    assert Bootstrap.decode(line).port == 4711

Standard library only, and cheap: every agent imports it at start-up.
"""

from __future__ import annotations

import base64
import json
from typing import NamedTuple

TOKEN_METADATA = "tpudist-token"  # the gRPC metadata key of the per-job token
TLS_NAME = "tpudist-launcher"  # the name in the control server's certificate, when agents dial it directly
MAX_MESSAGE_BYTES = 64 << 20  # both ends' send and receive limit (a Start for many processes, log batches)
MESSAGE_SIZE_OPTIONS = (("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES))


class Bootstrap(NamedTuple):
    """The agent's first stdin line: everything it needs to dial the launcher."""

    worker: int  # the host's index in the job
    host: str  # the address the launcher used to reach it (for messages)
    port: int  # the control server's port as seen from the host (the forwarded one over SSH)
    token: str  # the job's random token, sent as TOKEN_METADATA on every call
    die_with_parent: bool  # ask Linux for SIGTERM when the agent's parent (sshd's session) dies
    tpu_devices: str = ""  # the TPU preflight's device node globs ("": skip it, --skip-preflight)
    libtpu_lockfile: str = ""  # ... and libtpu's lock file
    address: str = ""  # host:port of the control server when dialled directly (--ray); "": 127.0.0.1:port
    tls_cert: str = ""  # the control server's certificate (PEM) to trust, when dialled directly

    def target(self) -> str:
        """What the agent dials."""
        return self.address or f"127.0.0.1:{self.port}"

    def encode(self) -> bytes:
        return base64.b64encode(json.dumps(self._asdict()).encode()) + b"\n"

    @classmethod
    def decode(cls, line: bytes) -> "Bootstrap":
        fields = json.loads(base64.b64decode(line))  # a newer launcher's extra fields are left out
        return cls(**{k: v for k, v in fields.items() if k in cls._fields})
