"""The one error curation raises for input or output it cannot use."""


class CurateError(RuntimeError):
    """The curation input or output cannot be used; the message says why and what to do."""
