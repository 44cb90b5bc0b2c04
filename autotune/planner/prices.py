"""What a GPU hour costs, for `autotune plan --prices FILE`: the cheapest offer per card and GPU count.

Two shapes of file are read, told apart by their header:

- **SkyPilot's catalog** as published (`catalogs/v7/<cloud>/vms.csv` in skypilot-org/skypilot-catalog):
  `InstanceType, AcceleratorName, AcceleratorCount, ..., Price, Region, ..., SpotPrice` in any order.
  Each row is an instance of `AcceleratorCount` cards at `Price` an hour; rows without an accelerator
  (CPU instances) and accelerators autotune has no card for (TPUs, AMD) are passed over and counted.
  An offer is for its count of cards only: a card sold in eights has no price for one.
(# lines before the header, as the shipped table's date and sources, are passed over.)
- **A plain table**: `card,price_per_gpu_hour[,spot_per_gpu_hour][,source]`: one price per GPU hour,
  for any count of that card.

A price is a number of dollars, at least 0; anything else is refused with its row. A card without a
price shows its time only: no price is ever invented. The default table (prices.csv beside this
module) ships with its date and each row's public source."""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from pathlib import Path

from autotune.specs.cards import Card, find_card
from autotune.vocabulary.errors import BadInput

SKYPILOT_COLUMNS = ("AcceleratorName", "AcceleratorCount", "Price")
PLAIN_COLUMNS = ("card", "price_per_gpu_hour")
DEFAULT_PRICES = Path(__file__).with_name("prices.csv")
# SkyPilot's accelerator names where they mean another card than autotune's alias of the same name:
# its "A100" is the 40 GB board (the 80 GB one is "A100-80GB").
SKYPILOT_NAMES = {"a100": "a100-40gb"}
MAX_PRICE_FILE_BYTES = 64 * 2**20  # (a whole cloud's catalog is a few MB)


@dataclass(frozen=True, slots=True)
class Offer:
    """The cheapest way found to rent `gpus` of one card: dollars per GPU hour, on demand and spot."""

    card: str  # the card's short name (autotune.specs.cards)
    gpus: int | None  # the count of cards this price is for; None: any count (a plain table)
    per_gpu_hour: float
    spot_per_gpu_hour: float | None
    source: str  # where the price is from: the file and row, the instance and region

    def to_dict(self) -> dict:
        return {
            "card": self.card,
            "gpus": self.gpus,
            "per_gpu_hour": self.per_gpu_hour,
            "spot_per_gpu_hour": self.spot_per_gpu_hour,
            "source": self.source,
        }


@dataclass(slots=True)
class PriceBook:
    """Offers by card and count (the cheapest of each), and what the file held that is no card's."""

    path: str
    offers: dict[tuple[str, int | None], Offer] = field(default_factory=dict)
    passed_over: dict[str, int] = field(default_factory=dict)  # accelerator name -> rows

    def offer(self, card: Card, gpus: int) -> Offer | None:
        """The price of `gpus` of `card`: an offer of that count, else one for any count; None: unpriced."""
        return self.offers.get((card.short_name, gpus)) or self.offers.get((card.short_name, None))

    def add(self, offer: Offer) -> None:
        key = (offer.card, offer.gpus)
        held = self.offers.get(key)
        if held is None or offer.per_gpu_hour < held.per_gpu_hour:
            spot = offer.spot_per_gpu_hour
            if held is not None and held.spot_per_gpu_hour is not None:
                spot = held.spot_per_gpu_hour if spot is None else min(spot, held.spot_per_gpu_hour)
            self.offers[key] = Offer(offer.card, offer.gpus, offer.per_gpu_hour, spot, offer.source)
        elif offer.spot_per_gpu_hour is not None and (
            held.spot_per_gpu_hour is None or offer.spot_per_gpu_hour < held.spot_per_gpu_hour
        ):
            self.offers[key] = Offer(held.card, held.gpus, held.per_gpu_hour, offer.spot_per_gpu_hour, held.source)


def read_prices(path: str | Path | None = None, *, flag: str = "--prices") -> PriceBook:
    """The price book in `path` (SkyPilot's catalog or a plain table), or the shipped default."""
    from autotune.host.config_files import read_config_text

    where = Path(path).expanduser() if path is not None else DEFAULT_PRICES
    text, _ = read_config_text(where, flag, max_bytes=MAX_PRICE_FILE_BYTES, what="price table")
    lines = text.splitlines(keepends=True)
    skipped = next((i for i, line in enumerate(lines) if not line.lstrip().startswith("#")), len(lines))
    rows = csv.DictReader(io.StringIO("".join(lines[skipped:])))
    header = [name.strip() for name in rows.fieldnames or []]
    rows.fieldnames = header
    book = PriceBook(str(where))
    if all(column in header for column in SKYPILOT_COLUMNS):
        _read_skypilot(rows, book, where, flag, skipped)
    elif all(column in header for column in PLAIN_COLUMNS):
        _read_plain(rows, book, where, flag, skipped)
    else:
        missing_sky = [c for c in SKYPILOT_COLUMNS if c not in header]
        missing_plain = [c for c in PLAIN_COLUMNS if c not in header]
        raise BadInput(
            f"{flag} {where}: a price file is SkyPilot's catalog (no column {', '.join(missing_sky)}) or a table "
            f"of card,price_per_gpu_hour (no column {', '.join(missing_plain)}); its header is "
            f"{','.join(header)[:120] or 'empty'}."
        )
    return book


def _read_skypilot(rows: csv.DictReader, book: PriceBook, where: Path, flag: str, skipped: int) -> None:
    for number, row in enumerate(rows, start=2 + skipped):  # (a row's number is its line in the file)
        name = (row.get("AcceleratorName") or "").strip()
        if not name:
            continue  # a CPU instance
        card = _card(name, (row.get("InstanceType") or ""))
        if card is None:
            book.passed_over[name] = book.passed_over.get(name, 0) + 1
            continue
        count = _number(row.get("AcceleratorCount"), "AcceleratorCount", number, where, flag)
        if count < 1 or count != int(count):
            continue  # a fraction of a card (a shared slice) is not a training run's unit
        price = _number(row.get("Price"), "Price", number, where, flag, blank_ok=True)
        if price is None:
            continue  # listed without an on-demand price
        spot = _number(row.get("SpotPrice"), "SpotPrice", number, where, flag, blank_ok=True)
        gpus = int(count)
        place = ", ".join(v for v in ((row.get("InstanceType") or "").strip(), (row.get("Region") or "").strip()) if v)
        book.add(
            Offer(
                card.short_name,
                gpus,
                price / gpus,
                None if spot is None else spot / gpus,
                f"{where.name} row {number}: {place}",
            )
        )


def _read_plain(rows: csv.DictReader, book: PriceBook, where: Path, flag: str, skipped: int) -> None:
    for number, row in enumerate(rows, start=2 + skipped):
        name = (row.get("card") or "").strip()
        if not name:
            raise BadInput(f"{flag} {where} row {number}: no card named; give a card's name, e.g. h100.")
        try:
            card = find_card(name)
        except BadInput as exc:
            raise BadInput(f"{flag} {where} row {number}: {str(exc).removeprefix('--gpu ')}") from None
        price = _number(row.get("price_per_gpu_hour"), "price_per_gpu_hour", number, where, flag)
        spot = _number(row.get("spot_per_gpu_hour"), "spot_per_gpu_hour", number, where, flag, blank_ok=True)
        source = (row.get("source") or "").strip() or f"{where.name} row {number}"
        book.add(Offer(card.short_name, None, price, spot, source))


def _card(name: str, instance_type: str = "") -> Card | None:
    """autotune's card for a catalog's accelerator name; the PCIe board where the instance type says
    so (SkyPilot names an H100 'H100' on either board, and the boards differ in speed and link)."""
    lowered = name.strip().lower()
    try:
        card = find_card(SKYPILOT_NAMES.get(lowered, lowered))
    except BadInput:
        return None
    if "pcie" in instance_type.lower():
        try:
            return find_card(f"{card.short_name}-pcie")
        except BadInput:
            return card
    return card


def _number(text: str | None, column: str, row: int, where: Path, flag: str, *, blank_ok: bool = False):
    """A price or count: a finite number of at least 0 (None for a blank where `blank_ok`)."""
    value = (text or "").strip()
    if not value:
        if blank_ok:
            return None
        raise BadInput(f"{flag} {where} row {row}: {column} is empty; give a number of dollars (e.g. 2.49).")
    try:
        number = float(value)
    except ValueError:
        raise BadInput(f"{flag} {where} row {row}: {column} {value[:30]!r} is not a number.") from None
    if not math.isfinite(number) or number < 0:
        raise BadInput(
            f"{flag} {where} row {row}: {column} {value[:30]!r} is not a price: give a number of at least 0."
        )
    return number
