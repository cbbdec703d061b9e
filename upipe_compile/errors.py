"""The one exception users see from upipe-compile."""


class UnsupportedAttention(RuntimeError):
    """An attention call (or an option) that UPipe cannot run correctly.

    Raised at compile time when the graph shows the problem, or at run time when only the
    values show it (for example shards of different lengths on different ranks). The message
    names the model's source line where one is known, the reason, and the fix.
    """
