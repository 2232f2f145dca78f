"""Errors the fleet raises to the driver (kept free of Ray imports so the CLI can catch them cheaply)."""


class RunFailed(RuntimeError):
    """The run stopped; the message says which rank failed, how, and how to resume."""
