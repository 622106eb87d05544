"""How a command stops on SIGTERM or Ctrl-C: with its note and without a traceback.

SIGTERM (systemd, kubectl, timeout) is made to stop a command the way Ctrl-C does: a
``KeyboardInterrupt``, so the reshard's workers finish the batch in hand, leases are let go and the
"what to run" note is printed. A signal's handler runs between any two bytecodes of the main
thread, so that interrupt can land inside a finalizer, and two finalizers treat it badly:

* SQLAlchemy's pool, returning a connection when the interrupt arrives, logs it with its traceback
  ("Exception during reset or similar") and then re-raises it. The command still stops as it
  should; the traceback is noise. :class:`OneLineLog` drops log records of an interrupt and prints
  every other record on one masked line, as lastResort did but without a traceback.
* A ``__del__`` cannot raise: Python prints "Exception ignored in ..." and the interrupt is lost,
  as it is for Ctrl-C in any Python program; a second signal stops the command. Re-raising it from
  the unraisable hook was tried and dropped (every way of flagging the signal again runs its handler
  inside the hook, where it is lost once more).
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading

from mdb.urls import mask_secrets

__all__ = ["OneLineLog", "install", "one_line", "terminated"]

_terminated: list[int] = []


def terminated() -> bool:
    """Whether a SIGTERM (rather than Ctrl-C) interrupted this process: exit 143, not 130."""
    return bool(_terminated)


def one_line(message: str) -> str:
    """A message with its line breaks folded: stderr lines a log scraper keeps whole."""
    return re.sub(r"\s*[\r\n]+\s*", " ", message).strip()


def _terminate(signum: int, frame: object) -> None:
    _terminated.append(signum)
    raise KeyboardInterrupt


class OneLineLog(logging.Handler):
    """Log records at WARNING and above as one masked line on the current ``sys.stderr``.

    The stream is looked up per record (not kept), so a command run in-process under a test's
    captured stderr writes where that run's stderr is.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def filter(self, record: logging.LogRecord) -> bool:
        exc_type = record.exc_info[0] if record.exc_info else None
        return not (exc_type is not None and issubclass(exc_type, KeyboardInterrupt)) and super().filter(record)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                exc = record.exc_info[1]
                text += f" ({type(exc).__name__}: {exc})" if str(exc) else f" ({type(exc).__name__})"
            sys.stderr.write(mask_secrets(one_line(text)) + "\n")
            sys.stderr.flush()
        except Exception:  # logging's own contract: a failing handler reports through handleError, never raises
            self.handleError(record)


def install() -> None:
    """Set up the running process for a command; idempotent (tests run ``main`` in-process)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _terminate)
    root = logging.getLogger()
    if not any(isinstance(h, OneLineLog) for h in root.handlers):
        root.addHandler(OneLineLog())
