"""The one error trace loading raises."""


class TraceError(ValueError):
    """A trace that cannot be analysed; str() is one line meant for the user."""
