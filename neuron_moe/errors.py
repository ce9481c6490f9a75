"""The one exception type the CLI turns into a clean `error: ...` line (exit 2), that line, and
Ctrl-C as the CLI takes it.

Anything a user can get wrong — a port file, a checkpoint, a flag — raises a subclass with a
message that names the problem. Anything else is a bug and keeps its traceback.
"""

import os
import sys
import threading


class UserError(Exception):
    pass


INTERRUPTED = 130  # a shell's status for a process ended by SIGINT (128 + 2)
RESEND_S = 0.05


def interrupt(signum, frame) -> None:
    """SIGINT as KeyboardInterrupt, as Python's own handler, except inside a finalizer (`__del__`, run
    by the garbage collector anywhere, in torch.export too), where Python prints the exception as
    'Exception ignored in' and carries on, the Ctrl-C lost: there the signal is sent again a moment
    later, once the finalizer is done."""
    while frame is not None:
        if frame.f_code.co_name == "__del__":
            threading.Timer(RESEND_S, os.kill, (os.getpid(), signum)).start()
            return
        frame = frame.f_back
    raise KeyboardInterrupt


def error_exit(message: str) -> int:
    """One `error:` line, whatever the message (a library's may span several): exit 2."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return 2
