"""The signature of apply_to_transformers' patched forwards, as Trainer reads it:
`inspect.signature(model.forward)` chooses which dataset columns reach the forward
(remove_unused_columns).

While a patch is active it is the class's own signature with the patched forward's keywords
(sample_ids, targets, hard_negative_*) added before its **kwargs; otherwise it is the class's own.
It is one object whose value follows the patch state, not a fixed value, because wrappers made while
applied keep it: accelerate's mixed precision (Trainer with bf16 / fp16) puts a functools.wraps
wrapper of the patched forward on the model instance, functools.wraps copies the wrapped function's
__signature__ into the wrapper, and inspect.signature reads the wrapper's copy. A fixed signature
there would keep the extra keywords after undo(). docs/transformers.md.
"""
import inspect


def with_keywords(signature, names):
    """`signature` with keyword-only parameters `names` (those it lacks, default None) before its **kwargs."""
    parameters = list(signature.parameters.values())
    at = next((i for i, p in enumerate(parameters) if p.kind is p.VAR_KEYWORD), len(parameters))
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
             for name in names if name not in signature.parameters]
    return signature.replace(parameters=parameters[:at] + added + parameters[at:])


class WhileApplied(inspect.Signature):
    """`own` with the keywords `names` while `applied()` is true, `own` otherwise. inspect.Signature's
    methods read `parameters` and `return_annotation`; `replace` (which inspect calls to drop `self`
    from a bound method) and pickling (copy.deepcopy) give a plain Signature of the current value."""
    __slots__ = ("_own", "_patched", "_applied")

    def __init__(self, own, names, applied):
        super().__init__()  # its own fields stay empty: every read goes through now()
        self._own, self._patched, self._applied = own, with_keywords(own, names), applied

    def now(self):
        """The plain Signature this one stands for at the moment."""
        return self._patched if self._applied() else self._own

    @property
    def parameters(self):
        return self.now().parameters

    @property
    def return_annotation(self):
        return self.now().return_annotation

    def replace(self, **changes):
        return self.now().replace(**changes)

    def __reduce__(self):
        return self.now().__reduce__()
