"""The one exception type for errors a user can cause, and ember's exit codes."""

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_HUNG = 70         # EX_SOFTWARE: the hang watchdog stopped a distributed run; restarted like a crash
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: interrupted on request, resumable


class EmberError(Exception):
    """A problem the user can fix: the message says what was wrong, where, and what to do."""
