"""The one exception type for errors a user can cause.

The CLI turns a `UserError` into one line on stderr and exit code 2. Library code raises it for anything the user
can fix (a missing file, a bad option, a dictionary made for another model); assertions stay for our own invariants.
"""


class UserError(Exception):
    """An error the user caused and can fix; its message is one line that says what to do."""
