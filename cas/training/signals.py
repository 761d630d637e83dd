"""Signal triggers for checkpoints: SIGTERM/SIGINT ask to save and stop, SIGUSR1 to save and go on.

The handlers only set flags; the training loop acts on them at its next step boundary
(``CheckpointManager.step_end``), so the checkpoint holds the last *completed* step and never a
half-applied optimizer update. The flags are plain attributes, not ``threading.Event``: a handler
runs in the main thread between bytecodes, and ``Event.set`` takes a lock that the interrupted
code may already hold. A second SIGINT while a stop is pending raises ``KeyboardInterrupt`` as
usual, so a user can still break out of a loop that never reaches a step boundary.

Handlers can only be changed from the main thread. A manager closed from another thread detaches
its handlers instead: from then on they pass each signal to the handler that was there before
(or the default action), so a process whose checkpoint manager is gone never ignores SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

log = logging.getLogger("cas.training.signals")

STOP_SIGNALS: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)
SAVE_SIGNALS: tuple[int, ...] = (signal.SIGUSR1,) if hasattr(signal, "SIGUSR1") else ()

_Handler = Callable[[int, FrameType | None], Any] | int | None


class SignalTriggers:
    """Installs flag-setting handlers and restores the previous ones on ``uninstall``."""

    def __init__(
        self, stop: Sequence[int] = STOP_SIGNALS, save: Sequence[int] = SAVE_SIGNALS
    ) -> None:
        self.stop_signals = tuple(stop)
        self.save_signals = tuple(save)
        self.stop_requested = False
        self.stop_signal: int | None = None
        self.save_requests = 0
        self._previous: dict[int, _Handler] = {}
        self._detached = False

    @property
    def installed(self) -> bool:
        """Whether our handlers are in place."""
        return bool(self._previous)

    def install(self) -> bool:
        """Install the handlers; False (and nothing changes) when not on the main thread."""
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            log.warning("checkpoint signal handlers not installed: not on the main thread")
            return False
        for signum in self.stop_signals:
            self._previous[signum] = signal.signal(signum, self._on_stop)
        for signum in self.save_signals:
            self._previous[signum] = signal.signal(signum, self._on_save)
        return True

    def uninstall(self) -> None:
        """Put back the handlers that were there before ``install``."""
        if threading.current_thread() is not threading.main_thread():
            self._detached = True  # the handlers pass signals on from now (module docstring)
            return
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _pass_on(self, signum: int, frame: FrameType | None) -> bool:
        """Once detached: do what the previous handler would have done. False while attached."""
        if not self._detached:
            return False
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)  # a handler runs on the main thread
            os.kill(os.getpid(), signum)
        return True

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        if self._pass_on(signum, frame):
            return
        if self.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.stop_requested = True
        self.stop_signal = signum

    def _on_save(self, signum: int, frame: FrameType | None) -> None:
        if self._pass_on(signum, frame):
            return
        self.save_requests += 1

    def take_save_request(self) -> bool:
        """Whether a save was asked for since the last call (and clear the request)."""
        if self.save_requests:
            self.save_requests = 0
            return True
        return False
