"""What the beyond-the-diagonal loss tests share: the relative error against an fp64 reference and
the order in which they return a loss and its gradients."""

# (loss, d image, d text, d hard negatives, d logit_scale, d logit_bias)
GRADIENT_NAMES = ("loss", "image", "text", "hard_negatives", "scale", "bias")


def max_relative_error(got, want, floor=1e-30):
    """max |got - want| over max(max |want|, floor), in fp64. A floor of 1 compares a value that can
    be exactly zero (d bias of a softmax loss without masks) in absolute terms."""
    want = want.double()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(floor)).item()


def assert_all_within(got, want, tol, case, floors=None):
    """Every entry of GRADIENT_NAMES: None where the reference is None, else within `tol`."""
    for name, g, w in zip(GRADIENT_NAMES, got, want):
        if w is None:
            assert g is None, (case, name)
            continue
        error = max_relative_error(g, w, (floors or {}).get(name, 1e-30))
        assert error <= tol, f"{case}: {name} relative error {error:.3g} > {tol:.3g}"
