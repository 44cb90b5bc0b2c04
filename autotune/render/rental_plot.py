"""Which card to rent, drawn (`plan --gpu A,B --gpus 1,2 --tokens N --plot FILE`): the whole run's
predicted time against its cost, one point per card and GPU count, the Pareto front joined and its
points named, the cheapest and the fastest marked. Options without a price sit on a strip below, by
time alone. An image (PNG, SVG, PDF) with matplotlib; written whole or not at all, as every figure
(render/plot.py)."""

from __future__ import annotations

from pathlib import Path

from autotune.host.output import Output
from autotune.planner.rental_plan import RentalPlan
from autotune.render.plot import DPI, check_out_file
from autotune.specs.models import shown_reference
from autotune.vocabulary.errors import BadInput
from autotune.vocabulary.units import format_tokens


def check_rental_plot(path: str, flag: str = "--plot") -> Path:
    """Refused before any trace: a file type other than an image, or a place no file can go."""
    if Path(path).suffix.lower() == ".html":
        raise BadInput(f"{flag}: the rental plot is drawn as an image; name it .png, .svg or .pdf")
    return check_out_file(path, flag)


def save_rental_plot(result: RentalPlan, out: Output) -> Path:
    """Draw `result` into `out` (an Output opened before the traces), committed here."""
    out.fill(lambda temp: _draw(result, temp))
    return out.commit()


def _draw(result: RentalPlan, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: draws to files only
    import matplotlib.pyplot as plt

    priced = [r for r in result.runnable if r.cost is not None]
    unpriced = [r for r in result.runnable if r.cost is None]
    fig, (ax, strip) = plt.subplots(
        2, 1, sharex=True, figsize=(8.4, 6.6), gridspec_kw={"height_ratios": [6, 1], "hspace": 0.08}
    )
    front = result.front
    ax.scatter(
        [r.seconds / 3600 for r in priced], [r.cost for r in priced], s=28, color="#7f8c8d", zorder=2, label="option"
    )
    if front:
        ax.plot(
            [r.seconds / 3600 for r in front],
            [r.cost for r in front],
            "-o",
            color="#c0392b",
            zorder=3,
            label="front: none both sooner and cheaper",
        )
    for rental in priced:
        mark = ", ".join(result.marks(rental))
        name = f"{rental.card.short_name} x{rental.gpus}" + (f" ({mark})" if mark else "")
        ax.annotate(name, (rental.seconds / 3600, rental.cost), textcoords="offset points", xytext=(4, 3), fontsize=7)
    strip.scatter([r.seconds / 3600 for r in unpriced], [0.0] * len(unpriced), s=18, color="#95a5a6", marker="s")
    for rental in unpriced:
        strip.annotate(
            f"{rental.card.short_name} x{rental.gpus}",
            (rental.seconds / 3600, 0.0),
            textcoords="offset points",
            xytext=(3, 3),
            fontsize=6,
            rotation=30,
        )
    strip.set_yticks([])
    strip.set_ylabel("no price", rotation=0, ha="right", va="center", fontsize=8)
    for axis in (ax, strip):
        axis.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylabel("the run's cost, $ on demand (predicted)")
    strip.set_xlabel("the run's time, hours (predicted)")
    error = result.speed_error
    band = f", speed ±{error.median:.0%}" if error is not None else ""
    ax.set_title(
        f"{shown_reference(result.model)}: {format_tokens(result.tokens)} tokens on each card and count{band}",
        fontsize=10,
    )
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=8, loc="upper right")
    fig.savefig(path, dpi=DPI, bbox_inches="tight")  # (the temporary file keeps the suffix: the format)
    plt.close(fig)
