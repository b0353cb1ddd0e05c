"""The one exception type for errors a user can cause.

The CLI turns a `UserError` into one line on stderr and exit code 2. Library code raises it for anything the user
can fix (a missing file, a bad option, a dictionary made for another model); assertions stay for our own invariants.
`SharedUserError` is the same error raised on every rank of a data-parallel run, said once, by rank 0.
"""


class UserError(Exception):
    """An error the user caused and can fix; its message is one line that says what to do."""


class SharedUserError(UserError):
    """The same UserError on every rank of a data-parallel run (found by a check they agreed on): the rank that
    `speaker` marks, rank 0, says it, the others exit with the same code quietly, so the user reads one line."""

    def __init__(self, message: str, speaker: bool = True):
        super().__init__(message)
        self.speaker = speaker
