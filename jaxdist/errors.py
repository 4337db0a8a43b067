"""The one exception type users see: a one-line message naming the cause and the fix."""


class JaxdistError(Exception):
    """A problem with the user's input or environment. The CLI prints it without a traceback, exit 2."""
