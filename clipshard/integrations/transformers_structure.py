"""What apply_to_transformers needs of a covered class, checked on the class itself rather than on
transformers' version string, and calls that work across the releases that differ in it.

Between transformers 4.50 and 5.x the covered forwards changed their signatures (4.5x name
`return_dict` and `output_attentions`; later releases take them through `**kwargs` or a
`can_return_tuple` wrapper) and `get_image_features` / `get_text_features` went from returning the
projected embeddings as a tensor (4.x) to returning an output whose `pooler_output` they are (5.x).
The patch relies only on what `problem()` checks: a `forward` of the class's own with a
`return_loss` parameter that also takes `return_dict`, an output class with `loss`, `image_embeds`
and `text_embeds` fields, `loss` first, and the two get_*_features methods. docs/transformers.md.
"""
import dataclasses
import inspect

import torch


def accepts(function, name):
    """Whether `function` can be called with the keyword argument `name`: a parameter of that name,
    or **kwargs in its own signature (a decorator's wrapper, such as can_return_tuple's, counts)."""
    parameters = inspect.signature(function, follow_wrapped=False).parameters
    return name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def problem(entry, cls):
    """Why `cls` (the class of Covered `entry`) cannot be patched, in a few words; None if it can."""
    forward = cls.__dict__.get("forward")
    if forward is None:
        return "it defines no forward of its own"
    if "return_loss" not in inspect.signature(forward).parameters:
        return "its forward has no return_loss parameter"
    if not accepts(forward, "return_dict"):
        return "its forward takes no return_dict"
    for method in ("get_image_features", "get_text_features"):
        if not callable(getattr(cls, method, None)):
            return f"it has no {method}"
    try:
        output = entry.output_class()
    except (ImportError, AttributeError):
        return f"its output class {entry.output} is not where it was"
    fields = [f.name for f in dataclasses.fields(output)] if dataclasses.is_dataclass(output) else []
    if not fields or fields[0] != "loss" or not {"image_embeds", "text_embeds"} <= set(fields):
        return f"its output class {entry.output} has no loss, image_embeds and text_embeds fields"
    return None


def features(method, arguments):
    """(embeddings, the tower's output or None) from get_image_features / get_text_features called
    with those of `arguments` it accepts: 4.x returns the embeddings (no tower output to return),
    5.x an output holding them in pooler_output."""
    accepted = {name: value for name, value in arguments.items() if accepts(method, name)}
    if accepts(method, "return_dict"):
        accepted["return_dict"] = True
    result = method(**accepted)
    if isinstance(result, torch.Tensor):
        return result, None
    return result.pooler_output, result
