"""The one exception type the CLI turns into a clean `error: ...` line (exit 2), that line, and
Ctrl-C as the CLI takes it.

Anything a user can get wrong — a port file, a checkpoint, a flag — raises a subclass with a
message that names the problem. Anything else is a bug and keeps its traceback.
"""

import os
import signal
import sys
import threading


class UserError(Exception):
    pass


INTERRUPTED = 130  # a shell's status for a process ended by SIGINT (128 + 2)
RESEND_S = 0.05


def interrupt(signum, frame) -> None:
    """SIGINT as KeyboardInterrupt, as Python's own handler, once: the SIGINTs after it are ignored,
    so that a second Ctrl-C does not cut short the clean-up the first one started."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def unraisable(info) -> None:
    """`sys.unraisablehook`: an exception raised where Python cannot raise it — a finalizer
    (`__del__`), a weakref callback, both run by the garbage collector anywhere, in torch.export
    too — is printed as 'Exception ignored in' and lost. A Ctrl-C lost there would let the command
    run on: the signal is sent again a moment later, once the callback is done. Anything else is
    printed as Python prints it."""
    if not issubclass(info.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(info)
        return
    if threading.current_thread() is threading.main_thread():  # where `interrupt` ran: armed again
        signal.signal(signal.SIGINT, interrupt)
    resend = threading.Timer(RESEND_S, os.kill, (os.getpid(), signal.SIGINT))
    resend.daemon = True
    resend.start()


def take_ctrl_c() -> tuple | None:
    """SIGINT raises KeyboardInterrupt (`interrupt`) and is never lost in a callback (`unraisable`);
    returns what was there before, for `restore_ctrl_c` (None: a caller had taken it already, and
    keeps it). The main thread only (Python's rule)."""
    if signal.getsignal(signal.SIGINT) is interrupt:
        return None
    previous = signal.signal(signal.SIGINT, interrupt), sys.unraisablehook
    sys.unraisablehook = unraisable
    return previous


def restore_ctrl_c(previous: tuple | None) -> None:
    if previous is not None:
        handler, sys.unraisablehook = previous
        signal.signal(signal.SIGINT, handler)


def _end_progress_bars() -> None:
    """Close the progress bars still open (tqdm's, drawn on stderr with carriage returns and no
    newline), so that the line printed next starts a line of its own."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def interrupted(command: str | None) -> int:
    """The one line of a command stopped by Ctrl-C (or SIGINT): exit 130. What it was writing was
    cleaned up on the way out."""
    _end_progress_bars()
    print(f"error: interrupted (Ctrl-C): neuron-moe {command + ' ' if command else ''}stopped", file=sys.stderr)
    return INTERRUPTED


def error_exit(message: str) -> int:
    """One `error:` line, whatever the message (a library's may span several), on a line of its
    own: exit 2."""
    _end_progress_bars()
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    return 2
