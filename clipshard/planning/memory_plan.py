"""What a memory plan says: one rank's peak and what is live at that moment (docs/scale.md)."""
from collections import defaultdict
from dataclasses import dataclass, field

_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_bytes(nbytes):
    """'1.50 GiB', '768.00 KiB', '12 B'."""
    for unit, size in _UNITS:
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


@dataclass
class MemoryPlan:
    """One rank's memory for the call planned.

    peak_bytes: the peak of the bytes allocated during the call (what existed before it, such as
        the loss's input features or a model's weights when `counted_before` says so, included
        only as stated there).
    peak_allocations: (bytes, what) of every allocation live at the peak, largest first.
    setting: the planned configuration, as (name, value) pairs.
    plan_seconds: how long tracing the plan took.
    """

    peak_bytes: int
    peak_allocations: list
    setting: list
    plan_seconds: float
    counted_before: list = field(default_factory=list)  # (bytes, what) already live when the call started

    def by_kind(self):
        """(bytes, what, count) of the allocations at the peak, grouped by what they are, largest first."""
        groups = defaultdict(lambda: [0, 0])
        for nbytes, what in self.peak_allocations:
            groups[what][0] += nbytes
            groups[what][1] += 1
        return sorted(((b, what, n) for what, (b, n) in groups.items()), key=lambda g: -g[0])

    def report(self, rows=12, file=None):
        """Prints the plan: the setting, the peak, and the largest groups of allocations at the peak."""
        print(self.table(rows), file=file)

    def table(self, rows=12):
        """The text `report` prints."""
        lines = ["clipshard memory plan: " + ", ".join(f"{name}={value}" for name, value in self.setting),
                 f"peak per rank: {format_bytes(self.peak_bytes)} ({self.peak_bytes} bytes), "
                 f"planned in {self.plan_seconds:.1f} s"]
        for nbytes, what in self.counted_before:
            lines.append(f"  included, live before the call: {format_bytes(nbytes):>12}  {what}")
        lines.append(f"  {'bytes':>12}  {'count':>5}  allocation live at the peak (made by: op -> shape dtype)")
        groups = self.by_kind()
        for nbytes, what, count in groups[:rows]:
            lines.append(f"  {format_bytes(nbytes):>12}  {count:>5}  {what}")
        if len(groups) > rows:
            rest = sum(g[0] for g in groups[rows:])
            lines.append(f"  {format_bytes(rest):>12}  {sum(g[2] for g in groups[rows:]):>5}  "
                         f"({len(groups) - rows} smaller kinds)")
        return "\n".join(lines)
