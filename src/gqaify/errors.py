"""Errors that are the user's to fix.

A `UserError` carries one line that names the problem and the fix. The CLI prints it and exits with
status 2; anything else that escapes is a bug in gqaify and exits with status 1.
"""


class UserError(Exception):
    """Bad input: a message of one line naming the problem and how to fix it."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


def raise_if_problems(problems: list[str]) -> None:
    """Raise one `UserError` carrying every problem found, so the user fixes them all in one go."""
    if problems:
        raise UserError("; ".join(problems))
