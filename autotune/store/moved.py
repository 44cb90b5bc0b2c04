"""A study follows its model to where it is now.

A study is of one model by fingerprint (its architecture), wherever the model's directory lies; a
config's key, though, names the model's recorded reference (a local directory's absolute path,
ModelSpec.recorded), so that `train` and a worker find it. A study resumed with the same model at
another path (a second checkout, a moved directory) would otherwise measure every config again
under new keys, and its leaderboard would show each config twice, once per path. Instead the
study's probes, claims and stored decision move to the new reference in the resuming write, and
every later read (the leaderboard, `best`, `train`) finds the model where it is now.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from autotune.levers.config import ProbeConfig
from autotune.store.rows import CONFIG_FIELDS
from autotune.store.schema import Claim, Probe, Study


def move_study(session: Session, study: Study, reference: str) -> None:
    """Re-key `study`'s probes, claims, confirmation and plan for the model at `reference` (the
    same model by fingerprint: the caller checked). Keys that are no config's (the confirmation
    round's claim) stay as they are."""
    moved: dict[str, str] = {}
    for probe in session.scalars(select(Probe).where(Probe.study_id == study.id)):
        config = ProbeConfig(**{name: getattr(probe, name) for name in CONFIG_FIELDS})
        new_key = ProbeConfig(**{**config.to_dict(), "model": reference}).key()
        moved[probe.config_key] = new_key
        probe.model, probe.config_key = reference, new_key
    # A study measured at several paths has a claim of each config at each: one stands, the one
    # already at the new path first (the claims that keep their key are seen first).
    claims = sorted(
        session.scalars(select(Claim).where(Claim.study_id == study.id)),
        key=lambda claim: moved.get(claim.config_key, claim.config_key) != claim.config_key,
    )
    taken: set[str] = set()
    for claim in claims:
        new_key = moved.get(claim.config_key, claim.config_key)
        if new_key in taken:
            session.delete(claim)
        else:
            taken.add(new_key)
    session.flush()  # (the deletes first: the updates below then meet no claim of their new key)
    for claim in claims:
        if claim not in session.deleted and claim in session:
            claim.config_key = moved.get(claim.config_key, claim.config_key)
    session.flush()
    if study.confirmation and len(set(moved.values())) < len(moved):
        # Configs measured at two paths meet on one key: the stored decision weighed them as two (a
        # round of the duplicates, "tied with itself"); the next search decides again.
        study.confirmation = None
    elif study.confirmation:
        study.confirmation = _rekeyed_decision(study.confirmation, lambda key: moved.get(key, key))
    if study.plan and study.plan.get("predictions"):
        study.plan = {**study.plan, "predictions": {moved.get(k, k): v for k, v in study.plan["predictions"].items()}}
    study.model_reference = reference


def _rekeyed_decision(decision: Mapping[str, Any], new: Callable[[str], str]) -> dict[str, Any]:
    """The stored decision (search/confirm.py) with every config key it holds renamed."""
    out = dict(decision)
    if out.get("winner"):
        out["winner"] = new(out["winner"])
    if out.get("tied_keys"):
        out["tied_keys"] = [new(key) for key in out["tied_keys"]]
    for field in ("windows", "by_round"):
        if out.get(field):
            out[field] = {new(key): value for key, value in out[field].items()}
    return out
