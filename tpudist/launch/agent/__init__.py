"""The per-host agent: `python -m tpudist.launch.agent`, started by the launcher on every host.

The launcher writes one bootstrap line to the agent's stdin (`tpudist.launch.control.Bootstrap`).
The agent then registers over the gRPC control plane, opens its `Session` stream and runs what the
launcher sends (Start, Signal, Stop, Shutdown), reporting Started / Exited / log lines back:

    __main__.py     the entry: defers the imports the agent never uses, then runs `_agent.main`
    _agent.py       the agent: bootstrap, control stream, and never outliving its launcher
    _processes.py   this host's processes: start, exits, stopping
    _pipes.py       each process's stdout / stderr, read into log lines
    _deferred.py    the deferred imports (measured in docs/launcher.md)

Importing this package imports nothing: every host's agent start-up pays for each import.
"""
