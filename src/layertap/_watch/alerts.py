"""The watch's alerts: `Alerts`, the rules, and the judge that applies them to each sampled step.

An `Alert` is something wrong at a sampled step: the first non-finite value of the run, dead
units, or a layer whose scale explodes. Each fires once per layer and phase; the judge keeps what
it already said, and the first std of each row that an explosion is measured against.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from .rows import Record


@dataclasses.dataclass(frozen=True)
class Alert:
    """Something wrong at a sampled step; ``layer`` is the first row it concerns, in the order the
    forward (or the backward) reached them, ``layers`` every row newly concerned."""

    kind: Literal["nonfinite", "dead", "explode"]
    step: int
    phase: Literal["forward", "backward"]
    layer: str
    module_type: str
    layers: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass(frozen=True)
class Alerts:
    """When `watch` raises an alert; each fires once per layer and phase.

    Attributes:
        nonfinite: the first NaN or Inf of the whole run (one alert).
        dead_fraction: the share of a layer output's channels that are exactly zero in the whole
            sampled step, above which dead units are reported (``None``: never).
        explode_factor: a row's std this many times its first sampled (finite, non-zero) std.
        explode_threshold: a row's largest finite magnitude above this.
    """

    nonfinite: bool = True
    dead_fraction: float | None = 0.5
    explode_factor: float | None = 100.0
    explode_threshold: float | None = 1e4


def _phase(kind: str) -> Literal["forward", "backward"]:
    return "forward" if kind == "output" else "backward"


def _what(kind: str) -> str:
    return "output" if kind == "output" else "output gradient"


class Judge:
    """Turns each sampled step's records into alerts, remembering what it already said."""

    def __init__(self, rules: Alerts) -> None:
        self.rules = rules
        self.nonfinite_seen = False
        self.first_std: dict[tuple[str, str], tuple[int, float]] = {}
        self.said: set[tuple[str, str, str]] = set()  # (alert kind, row kind, row name)

    def alerts(self, step: int, records: list[Record]) -> list[Alert]:
        out: list[Alert] = []
        rules = self.rules
        for kind in ("output", "grad"):
            rows = [r for r in records if r.kind == kind]
            if kind == "grad":
                rows.reverse()  # in the order the backward reached them
            if rules.nonfinite and not self.nonfinite_seen:
                bad = [r for r in rows if r.stats.nonfinite_fraction > 0]
                if bad:
                    self.nonfinite_seen = True
                    s = bad[0].stats
                    out.append(self._alert("nonfinite", step, kind, bad, (
                        f"layertap.watch: step {step}, {_phase(kind)}: layer {s.name!r} ({s.module_type}) is the first "
                        f"whose {_what(kind)} holds non-finite values (NaN {s.nan_fraction:.3g}, Inf {s.inf_fraction:.3g})"
                        + _also(bad)
                    )))  # fmt: skip
            if kind == "output" and rules.dead_fraction is not None:
                limit = rules.dead_fraction
                dead = [r for r in rows if r.dead_fraction > limit and ("dead", kind, r.name) not in self.said]
                if dead:
                    s = dead[0].stats
                    out.append(self._alert("dead", step, kind, dead, (
                        f"layertap.watch: step {step}: {len(s.dead_channels)} of {s.channels} channels of layer {s.name!r} "
                        f"({s.module_type}) are dead (exactly 0 in the whole step), more than {limit:.0%}" + _also(dead)
                    )))  # fmt: skip
            out += self._explode(step, kind, rows)
        return out

    def _explode(self, step: int, kind: str, rows: list[Record]) -> list[Alert]:
        rules, why = self.rules, {}
        for r in rows:
            s, key = r.stats, (kind, r.name)
            first = self.first_std.get(key)
            if first is None and math.isfinite(s.std) and s.std > 0:
                self.first_std[key] = first = (step, s.std)
            if ("explode", kind, r.name) in self.said:
                continue
            if rules.explode_factor is not None and first is not None and s.std > rules.explode_factor * first[1]:
                why[r.name] = f"std {s.std:.4g} is {s.std / first[1]:.3g}x its first sampled value {first[1]:.4g} (step {first[0]})"
            elif rules.explode_threshold is not None and s.absmax > rules.explode_threshold:
                why[r.name] = f"largest magnitude {s.absmax:.4g} is above {rules.explode_threshold:.4g}"
        if not why:
            return []
        hit = [r for r in rows if r.name in why]
        s = hit[0].stats
        message = (
            f"layertap.watch: step {step}, {_phase(kind)}: the scale of layer {s.name!r} ({s.module_type}) explodes, "
            f"its {_what(kind)}'s {why[s.name]}" + _also(hit)
        )
        return [self._alert("explode", step, kind, hit, message)]

    def _alert(self, what: Literal["nonfinite", "dead", "explode"], step: int, kind: str, rows: list[Record], message: str) -> Alert:
        self.said.update((what, kind, r.name) for r in rows)
        s = rows[0].stats
        return Alert(what, step, _phase(kind), s.name, s.module_type, tuple(r.name for r in rows), message)


def _also(rows: list[Record]) -> str:
    if len(rows) == 1:
        return ""
    more = ", ".join(repr(r.name) for r in rows[1:4])
    return f"; also {len(rows) - 1} later: {more}{' ...' if len(rows) > 4 else ''}"


__all__ = ["Alert", "Alerts", "Judge"]
