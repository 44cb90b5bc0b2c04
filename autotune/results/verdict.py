"""The one text of a study's decision: why its pick was chosen, said from the decision the study
stores (`confirmation`, search/confirm.py) and never worked out again. The search's "Chosen:"
lines, the leaderboard's warning, `autotune best` and `print(best)`, `report` and the service all
say it through these functions, so that they name the same config for the same reason. The pick
itself is the ranking's first (autotune.results.ranking reads the same decision). No torch, no database.

A decision is one of:
- confirmed: measured again, the winner beat the runner-up by more than their noise;
- the only config that fits;
- a tie told apart by nothing but noise: within a small noise the configs are as fast as each
  other, and the one with the most memory to spare is chosen; beyond it (`reliable` False) the
  timing could not resolve them, and the fastest measured is kept;
- unconfirmed: the contenders could not be measured again, or the round could not take in every
  config as fast as its best (the fastest measured is kept, not reliable);
- none (no round ran: `--no-confirm`, a search stopped early), or a round still going (`partial`).
"""

from __future__ import annotations

from typing import Any

Decision = dict[str, Any]


def decided(decision: Decision | None) -> bool:
    """A round ran to its verdict (not none, not one left unfinished)."""
    return decision is not None and decision.get("winner") is not None and not decision.get("partial")


def is_tie(decision: Decision | None) -> bool:
    return decided(decision) and bool(decision.get("tied"))  # type: ignore[union-attr]


def reliable(decision: Decision | None) -> bool:
    """False when the timing could not tell the contenders apart beyond its noise (True where no
    round decided: nothing said otherwise)."""
    return not decided(decision) or bool(decision.get("reliable", True))  # type: ignore[union-attr]


def known_reliable(decision: Decision | None) -> bool | None:
    """Whether a round told the pick apart from its contenders beyond the timing noise; None where
    no round decided (`--no-confirm`, a search stopped early): not known, which
    a user must not read as reliable."""
    if not decided(decision):
        return None
    return bool(decision.get("reliable", True))  # type: ignore[union-attr]


def confirmed(decision: Decision | None, winner_key: str) -> bool:
    """Told apart from the configs within noise of it by measuring them again."""
    return decided(decision) and bool(decision.get("confirmed")) and decision.get("winner") == winner_key  # type: ignore[union-attr]


def how_chosen(decision: Decision | None) -> str:
    """How a tie was settled, in the words every surface uses."""
    if reliable(decision):
        return "chose the one with the most memory to spare that none of them was clearly faster than"
    return "kept the fastest measured"


def ranked_as(decision: Decision | None) -> str:
    """The why line's first words: 'fastest', 'tied for fastest', or 'fastest measured'."""
    if is_tie(decision):
        return "tied for fastest"
    if decided(decision) and not reliable(decision):
        return "fastest measured"
    return "fastest"


def describe(decision: Decision) -> str:
    """The decision in one line (the search's, under its Chosen line)."""
    c = decision
    if c.get("partial"):
        return (
            f"unconfirmed: the confirmation round was cut short after {c.get('probes', 0)} windows "
            f"({c.get('rounds', 0)} rounds); the same command goes on with them"
        )
    cost = f" ({c['probes']} more probes, {c['seconds']:.1f} s)" if c.get("probes") else ""
    margin, noise = c.get("margin"), c.get("noise") or 0.0
    if c.get("runner_up") is None:
        return f"confirmed: {c['winner_label']} is the only config measured that fits{cost}"
    if c.get("tied"):
        return (
            f"tie: {c['winner_label']} and {', '.join(c['tied'])} differ by {100 * (margin or 0):.0f}%, not told "
            f"apart (±{100 * noise:.0f}% of noise, or a round lost){cost}: {how_chosen(c)}"
        )
    if not c.get("confirmed"):
        why = (
            "every window was measured by earlier studies: no round ran"
            if c.get("reused")
            else "the contenders could not all be measured again"
        )
        return f"unconfirmed: {c['winner_label']} is the fastest measured, not told apart from {c['runner_up']} ({why}){cost}"
    how = "measured again" if c.get("rounds") else "told apart by the first windows"
    by, within = margin_and_noise(margin or 0.0, noise)
    return (
        f"confirmed: {c['winner_label']} wins by {by} ± {within} over "
        f"{c['runner_up']} ({how}{cost.replace(' (', ', ').rstrip(')') if cost else ''})"
    )


def margin_and_noise(margin: float, noise: float) -> tuple[str, str]:
    """A confirmed winner's margin and the noise it beat, as percents that show the margin is the
    larger: whole percents, or tenths or hundredths where whole ones would read alike ("wins by 6%
    ± 6%" said a margin of 6.4% over 5.6% of noise, which reads as inside it)."""
    digits = next((d for d in (0, 1) if round(100 * margin, d) > round(100 * noise, d)), 2)
    return f"{100 * margin:.{digits}f}%", f"{100 * noise:.{digits}f}%"


def answer(decision: Decision | None, winner_key: str) -> str:
    """`print(best)`'s "confirmed:" line: yes or no, and why, as `describe` says it."""
    if not decision:
        return "no: no confirmation round ran (--no-confirm, or a search stopped early): not known to be reliable"
    if decision.get("partial"):
        return "no: " + describe(decision).removeprefix("unconfirmed: ")
    if decision.get("winner") != winner_key:
        # (the ranking puts the decision's winner first: a best of another config means timings
        # changed since, a resumed search measured more)
        return f"no: measured since the confirmation round, which chose {decision.get('winner_label')}"
    if decision.get("runner_up") is None:
        return "yes: the only config measured that fits"
    noise = 100 * (decision.get("noise") or 0)
    if decision.get("tied"):
        return f"no, a tie: within the {noise:.0f}% noise of {', '.join(decision['tied'])}; {how_chosen(decision)}"
    if not decision.get("confirmed"):
        return f"no: not told apart from the runner-up, {decision['runner_up']}; the fastest measured"
    by, within = margin_and_noise(decision.get("margin") or 0.0, decision.get("noise") or 0.0)
    return f"yes: {by} ± {within} faster than the runner-up, {decision['runner_up']}"


def unreliable_warning(decision: Decision | None) -> str | None:
    """One line when the timing could not tell the contenders apart beyond its noise: the pick is
    not reliable, and what to do. None for a reliable (or undecided) pick."""
    if reliable(decision):
        return None
    assert decision is not None
    load = decision.get("host_load")
    busy = f", on a host loaded {load:.1f} per core" if load is not None else ""
    return (
        f"the pick is not reliable: its contenders' timings disagree by up to ±{100 * (decision.get('noise') or 0):.0f}%"
        f"{busy}; search again when the machine is quiet, or with a longer --measure-seconds (--fresh measures anew)"
    )
