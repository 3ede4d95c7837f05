"""The project's exceptions for errors a user can cause, by meaning, and ember's exit codes.

Library code raises the class that says what went wrong; the CLI maps them to exit codes
(ember.cli.main.exit_code) and the web layer to HTTP statuses (ember.web.error_responses), each in one place.

    BadInput      the request or an argument is malformed or out of range: fix it and ask again
    NotFound      what it names (a job, a run, a file) does not exist
    Conflict      it exists, but its state forbids this now (a finished job paused, a name taken)
    Refused       a policy or permission forbids it (the owner's allowed folders, the gate)
    Unavailable   a resource is not ready or busy: the same request may succeed later
    EmberError    the base: any other problem the user can fix (a bad recipe, a corrupt checkpoint)

Every one is an EmberError, so `except EmberError` still catches them all.
"""

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_HUNG = 70         # EX_SOFTWARE: the hang watchdog stopped a distributed run; restarted like a crash
EXIT_INTERRUPTED = 75  # EX_TEMPFAIL: interrupted on request, resumable


class EmberError(Exception):
    """A problem the user can fix: the message says what was wrong, where, and what to do."""


class BadInput(EmberError):
    """The request or an argument is malformed or out of range."""


class NothingToQuantize(BadInput):
    """[method] quantize = 'nf4' on a model with no layer bitsandbytes stores in 4 bits
    (ember.train.quantize; the plan's search skips QLoRA for it: ember.plan.fit)."""


class NotFound(EmberError):
    """What the request names does not exist."""


class Conflict(EmberError):
    """The thing exists, but its current state forbids the action."""


class Refused(EmberError):
    """A policy or a permission forbids the action."""


class Unavailable(EmberError):
    """A resource is not ready or is busy; the same request may succeed later."""
