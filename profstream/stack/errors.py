"""The one error of the local broker that a user can fix."""

from __future__ import annotations


class StackError(Exception):
    """A problem the user can fix; ``str()`` is one line that says what to do."""

    def __init__(self, message: str, detail: str = "") -> None:
        message = " ".join(str(message).split())
        super().__init__(message)
        self.detail = detail
        """Optional multi-line context (e.g. the tail of a log), for verbose output."""


class TopicAccessError(StackError):
    """A topic the broker does not show this client and does not let it create: an ACL is
    missing (the message, one line, names it)."""
