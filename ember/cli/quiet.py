"""What the libraries under ember say stays off its console: ember's own warnings are events the
commands print; a library's are for whoever debugs ember, not for its user.

    deprecations (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
                 ignored: they ask ember's developers to change a call (the test suite shows them)
    other Python warnings, and library log records no handler of the library's own takes
                 appended to $EMBER_HOME/logs/libraries.log (time, pid, where, what)
    transformers and the Hugging Face hub
                 errors only, no progress bars (their own handlers write to stderr)

-W or PYTHONWARNINGS keep the user's own choice of warnings.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path

from ember.paths import home


class LibraryLog(logging.FileHandler):
    """$EMBER_HOME/logs/libraries.log, opened (and its folder made) at the first record."""

    def __init__(self) -> None:
        super().__init__(home().libraries_log, delay=True)
        self.setFormatter(logging.Formatter("%(asctime)s pid %(process)d %(name)s %(levelname)s: %(message)s"))

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()

    def handleError(self, record: logging.LogRecord) -> None:
        # A library's log that cannot be written (a read-only home) is not worth a traceback on
        # the user's console, which is what logging's default does here; the record is dropped.
        return


def quiet_libraries() -> None:
    """Route library warnings and log records away from the console (the module docstring)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers is imported
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:  # imported already (a warm test process): tell it directly
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if not sys.warnoptions:
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category)
        logging.captureWarnings(True)  # the rest, as records of the 'py.warnings' logger
    root = logging.getLogger()
    if not any(isinstance(h, LibraryLog) for h in root.handlers):
        root.addHandler(LibraryLog())
