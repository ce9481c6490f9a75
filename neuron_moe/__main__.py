"""`python -m neuron_moe` and the `neuron-moe` script: Ctrl-C taken from the first instruction to
the last. Its handler is set before anything else is imported, so a SIGINT during the imports
(torch's take seconds) or the parsing is the same one line and exit 130 as one during the work;
once the command has returned, the exit (flushing, joining threads) runs to its end."""

import signal
import sys

from .errors import interrupted, take_ctrl_c


def main() -> int:
    take_ctrl_c()
    try:
        from .cli import main as run

        status = run()
    except KeyboardInterrupt:  # outside the command's own handling: its imports, or the way out
        status = interrupted(None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return status


if __name__ == "__main__":
    sys.exit(main())
