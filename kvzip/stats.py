"""Small statistics shared by the bench and scripts/results_tables.py (no torch here, so the script stays fast)."""

from __future__ import annotations


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion (95% at z = 1.96); unlike the normal approximation it stays
    inside [0, 1] and does not shrink to a point at 0 or n successes, which matters at a few dozen problems."""
    if n == 0:
        return 0.0, 1.0
    centre = (successes + z * z / 2) / (n + z * z)
    half = z * (successes * (n - successes) / n + z * z / 4) ** 0.5 / (n + z * z)
    return max(0.0, centre - half), min(1.0, centre + half)
