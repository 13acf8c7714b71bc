"""The logits every reference starts from."""


def similarity_reference(rows, cols, scale, bias=None):
    """S = scale * rows @ cols^T (+ bias), in fp64."""
    logits = scale.double() * rows.double() @ cols.double().T
    return logits if bias is None else logits + bias.double()
