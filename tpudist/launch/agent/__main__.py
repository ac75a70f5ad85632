"""`python -m tpudist.launch.agent`: the agent's process. Runs on every host of a job, so it is cheap.

What grpc and protobuf import but the agent never uses is deferred before anything imports them
(`_deferred.py`); only then is the agent itself imported.
"""

from tpudist.launch.agent import _deferred

_deferred.defer(_deferred.AGENT_MODULES)

from tpudist.launch.agent._agent import run_main  # noqa: E402

run_main()
