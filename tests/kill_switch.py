"""Run the CLI in this process and SIGKILL it at a chosen call: ``python tests/kill_switch.py ARGS...``.

``KILL_AT="module:function:N[:text]"`` kills the process just before the N-th call of ``module.function``
(counting only calls whose arguments' repr contains ``text``): no cleanup, no ``finally``, no flush, as
when a machine's OOM killer or a scheduler ends a job. ``COUNT_CALLS="module:function"`` appends a line
to ``$COUNT_FILE`` at every call. Both patch the module attribute before the package is imported, so
every ``from module import function`` in the package gets the patched one.
"""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys


def _patch(spec: str, action) -> None:
    module_name, name = spec.split(":")[:2]
    module = importlib.import_module(module_name)
    original = getattr(module, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        action(args, kwargs)
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def main() -> int:
    kill = os.environ.get("KILL_AT")
    if kill:
        parts = kill.split(":")
        target, text = int(parts[2]), parts[3] if len(parts) > 3 else ""
        seen = {"n": 0}

        def maybe_kill(args, kwargs):
            if text in repr((args, kwargs)):
                seen["n"] += 1
                if seen["n"] == target:
                    os.kill(os.getpid(), signal.SIGKILL)

        _patch(kill, maybe_kill)
    count = os.environ.get("COUNT_CALLS")
    if count:

        def record(_args, _kwargs):
            with open(os.environ["COUNT_FILE"], "a") as f:
                f.write("call\n")

        _patch(count, record)
    from aimet_quadapter.cli import main as cli

    return cli(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
