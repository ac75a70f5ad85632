"""The launcher's startup hook: every rank's stacks for hang reports, whether or not the program
ever calls `tpudist.init()`.

Each host's agent puts this directory first on PYTHONPATH of the processes it starts, with
TPUDIST_DEBUG_DIR naming the process's private directory. Python's `site` imports `sitecustomize`
at start-up, finds this one, which installs the stack dumper (`tpudist._stacks.install`: faulthandler
on a real-time signal, the progress record, the ready file), then runs the `sitecustomize` it
shadows (a distribution's or a venv's own), so nothing of the interpreter's set-up is lost.

Only one Python process of a rank at a time installs it (it claims the directory); the rest (a
wrapper's child, a DataLoader worker started with spawn) skip while it runs. A Python that does not
run `site` (`-S`, `-I`) or cannot import tpudist gets no dumper: the hang report says so for that rank.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _install() -> None:
    if not os.environ.get("TPUDIST_DEBUG_DIR"):
        return
    try:
        import tpudist._stacks as stacks
    except Exception:  # not importable by this interpreter: no dumper (the report says so)
        return
    stacks.install()


def _chain() -> None:
    """Runs the `sitecustomize` this module shadows, as `site` would have, under the same name."""
    import importlib.machinery
    import importlib.util

    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _install()
finally:
    # the directory leaves sys.path (the program sees its own path); the environment keeps it for
    # the processes the program starts, which find the directory claimed and skip
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    _chain()
