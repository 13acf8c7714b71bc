"""The way back from a function an integration installed to the library's own one.

apply_to_transformers and apply_to_sentence_transformers install functools.wraps wrappers of the
library's functions, marked `clipshard_patched`. An apply normally finds the library's own function
in the class (its module's state knows when a patch of its own is in place), but a patch that this
state does not know of may still be there: one made by a copy of the module reloaded since
(importlib.reload, IPython's autoreload). Recording that wrapper as the original would make undo()
put it back, so the applies look through it.
"""


def unpatched(function):
    """`function`, or the library's function under the clipshard wrappers around it."""
    while getattr(function, "clipshard_patched", False):
        function = function.__wrapped__
    return function
