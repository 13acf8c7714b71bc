"""What a kernel check of `python -m clipshard` yields (Measurement) and how it is listed (Check)."""
from dataclasses import dataclass


@dataclass
class Measurement:
    case: str          # what ran, e.g. "chunked bf16 backward"
    error: float       # the worst error (normalised, or a count of values that break the kernel's promise)
    tolerance: float
    note: str = ""

    @property
    def passed(self):
        return bool(self.error <= self.tolerance)  # False for a NaN error


@dataclass(frozen=True)
class Check:
    name: str
    run: object        # run(device) -> iterable of Measurement
    device_types: tuple = ("cpu", "cuda")
