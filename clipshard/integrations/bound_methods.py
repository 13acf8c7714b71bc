"""Whether a method an object holds as its own attribute runs a patched function.

A patch replaces a method on the class; an object that holds the method itself, bound before the
patch, keeps running the library's function: MatryoshkaLoss decorates a cached sentence-transformers
loss's bound `calculate_loss` when it is built, accelerate's mixed-precision `prepare` binds a
model's `forward`. The integrations' covers() / report() ask this module instead of the class alone.
"""

_MARK = "clipshard_patched"  # set on every function an integration installs


def own_method_bypasses_patch(obj, method):
    """Whether `obj` holds `method` as its own attribute and that attribute does not lead to a
    patched function (it runs the library's own, bound before the patch)."""
    own = vars(obj).get(method) if hasattr(obj, "__dict__") else None
    return own is not None and not _leads_to_patched(own)


def _leads_to_patched(function):
    """Whether `function` is, or wraps, a patched function; followed through `fn` (MatryoshkaLoss's
    CachedLossDecorator), `__wrapped__` (functools.wraps / update_wrapper) and `__func__` (a bound
    method)."""
    for _ in range(8):  # wrappers of wrappers, never a cycle
        if getattr(function, _MARK, False):
            return True
        function = (getattr(function, "fn", None) or getattr(function, "__wrapped__", None)
                    or getattr(function, "__func__", None))
        if function is None:
            return False
    return False
