"""How a command stops on SIGTERM or Ctrl-C: with its note, without a traceback, never ignoring the signal.

SIGTERM (systemd, kubectl, timeout) is made to stop a command the way Ctrl-C does: a
``KeyboardInterrupt``, so the reshard's workers finish the batch in hand, leases are let go and the
"what to run" note is printed. A signal's handler runs between any two bytecodes of the main
thread, so that interrupt can land inside a finalizer, and two finalizers treat it badly:

* SQLAlchemy's pool, returning a connection when the interrupt arrives, logs it with its traceback
  ("Exception during reset or similar") and then re-raises it. The command still stops as it
  should; the traceback is noise. :class:`OneLineLog` drops log records of an interrupt and prints
  every other record on one masked line, as lastResort did but without a traceback.
* A finalizer (``__del__``, a weakref callback such as the pool's own for a connection nobody
  closed) cannot raise: Python prints "Exception ignored in ..." with a traceback and the interrupt
  is lost, so the command would run on. The unraisable hook (:func:`_deliver_again`) prints
  nothing for an interrupt and sends the same signal to the main thread again from a short-lived
  thread 50 ms later, when the main thread has left the finalizer: sending it from the hook itself
  runs the handler inside the hook, where it is lost once more (tried; docs/dev/0024).
"""

from __future__ import annotations

import logging
import re
import signal
import sys
import threading
import time
from typing import Any

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
    """SIGTERM's handler: the interrupt Ctrl-C raises, remembered so the exit code says 143."""
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


REDELIVERY_DELAY_S = 0.05
"""How long after a finalizer swallowed an interrupt it is delivered again (:func:`_deliver_again`)."""

_previous_hook: list[Any] = []


def _deliver_again(unraisable: Any) -> None:
    """The unraisable hook: an interrupt a finalizer swallowed is delivered again; anything else goes to the hook before."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        signum = signal.SIGTERM if _terminated else signal.SIGINT
        try:
            threading.Thread(target=_interrupt_main_later, args=(signum,), name="mdb-interrupt-again", daemon=True).start()
            return
        except RuntimeError:  # the interpreter is shutting down: no thread; Python's report, as before
            pass
    (_previous_hook[0] if _previous_hook else sys.__unraisablehook__)(unraisable)


def _interrupt_main_later(signum: signal.Signals) -> None:
    time.sleep(REDELIVERY_DELAY_S)
    main = threading.main_thread().ident
    if main is not None:
        # A real signal, not _thread.interrupt_main(): that one only flags the handler, and a main
        # thread blocked in a system call (a socket read, a sleep) would not see it until the call ends.
        signal.pthread_kill(main, signum)


def install() -> None:
    """Set up the running process for a command; idempotent (tests run ``main`` in-process)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGTERM, _terminate)
    root = logging.getLogger()
    if not any(isinstance(h, OneLineLog) for h in root.handlers):
        root.addHandler(OneLineLog())
    if sys.unraisablehook is not _deliver_again:
        _previous_hook[:] = [sys.unraisablehook]
        sys.unraisablehook = _deliver_again
