"""``python -m turbospark``: the command line lives in ``cli/``.

SIGTERM raises ``KeyboardInterrupt`` from the first line on, so a signal that arrives while the
start-up imports run ends the process with the documented status (130), like one that arrives
while models are prepared; ``serve`` installs its own handling once it runs.
"""

import signal
import sys


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupted)
    try:
        from .cli.main import main

        code = main()
    except KeyboardInterrupt:
        print("turbospark: interrupted while starting", file=sys.stderr)
        code = 130
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ending now: quietly, even mid-atexit
    sys.exit(code)
