"""The rules a field's values must meet, declared beside the field in `setting(..., check=...)`: `Range`,
`Limit`, `Finite`, `Needs`, `Excludes`, `OnePerItem`, `OneOf`, and `SEED`. Each rule's `problem` returns one problem (a
string) or None, and never raises.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gqaify.settings.fields import shown
from gqaify.settings.stage import Context


@dataclass(frozen=True)
class Range:
    """A number from `low` (above it, with `low_open`) to `high` (below it, with `high_open`); a bound may name
    another field, and is then that field's value. NaN and the infinities are in no range.

    Reported as "--seq-len 1 must be at least 2" (`says` words the range where the default would not say enough,
    `fix` adds what to do).
    """

    low: float | str | None = None
    high: float | str | None = None
    low_open: bool = False
    high_open: bool = False
    says: str | None = None
    fix: str | None = None

    def problem(self, field: str, value, ctx: Context) -> str | None:
        low, high = (ctx.value(b) if isinstance(b, str) else b for b in (self.low, self.high))
        if ctx.follow_bounds and any(isinstance(b, str) and ctx.breaks_a_rule(b) for b in (self.low, self.high)):
            return None  # the bound's own problem is reported
        above_low = low is None or (value > low if self.low_open else value >= low)
        below_high = high is None or (value < high if self.high_open else value <= high)
        finite = isinstance(value, int) or math.isfinite(value)  # an int too large for a float is finite too
        if finite and above_low and below_high:
            return None
        must = self.says or self.words(ctx)
        if not finite:  # inf is above every low bound: "must be a positive number" would not say what is wrong
            must = f"{must}, and finite"
        return ctx.requirement(field, value, f"must be {must}", self.fix)

    def words(self, ctx: Context) -> str:
        """ "at least 2", "between 1 and --seq-len 2048", "in (0, 1]", "0 or more and below --length 256"."""
        low, high = (ctx.said(b) if isinstance(b, str) else _number(b) for b in (self.low, self.high))
        if self.low is not None and self.high is not None:
            if not (self.low_open or self.high_open):
                return f"between {low} and {high}"
            if not (isinstance(self.low, str) or isinstance(self.high, str)):
                return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        said = []
        if self.low is not None:
            zero = self.low == 0
            said.append(
                ("a positive number" if zero else f"above {low}")
                if self.low_open
                else ("0 or more" if zero else f"at least {low}")
            )
        if self.high is not None:
            said.append(f"below {high}" if self.high_open else f"at most {high}")
        return " and ".join(said)


@dataclass(frozen=True)
class Limit:
    """A cap on what a number costs (memory, time, disk) rather than a bound on what it means: "--refine-steps
    2000000 is more than the 1,000,000 allowed (why); lower it"."""

    most: int
    why: str

    def problem(self, field: str, value, ctx: Context) -> str | None:
        if value <= self.most:
            return None
        return f"{ctx.said(field, value)} is more than the {self.most:,} allowed ({self.why}); lower it"


@dataclass(frozen=True)
class Finite:
    """A finite number: "--refine-lr nan is not a finite number; give a positive one"."""

    fix: str

    def problem(self, field: str, value, ctx: Context) -> str | None:
        return None if math.isfinite(value) else f"{ctx.said(field, value)} is not a finite number; {self.fix}"


@dataclass(frozen=True)
class CountOr:
    """A whole number of 1 or more, or one `word` that asks gqaify to choose it: "--micro-batch-size 0 must be a
    positive integer or auto"."""

    word: str

    def problem(self, field: str, value, ctx: Context) -> str | None:
        if value == self.word or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return None
        return ctx.requirement(field, value, f"must be a positive integer or {self.word}", None)


@dataclass(frozen=True)
class Needs:
    """When this field's value meets `when` (by default: it is true), another `field` must be set, or with
    `value`, set to it: "--chat wraps prompts in the chat template; pass --prompts"."""

    field: str
    why: str
    when: Callable[[object], bool] = bool
    value: object = None  # None: any value but None

    def problem(self, field: str, value, ctx: Context) -> str | None:
        other = ctx.value(self.field)
        if not self.when(value) or (other is not None if self.value is None else other == self.value):
            return None
        subject = ctx.name(field) if value is True else f"{ctx.name(field)} {value}"
        return f"{subject} {self.why}; {ctx.ask(self.field, self.value)}"


# what numpy's generator takes (accelerate's set_seed seeds it), well inside torch's with the seeds derived from it
# (seed x 1,000,003 + shard or epoch): a seed past it was a traceback, after OUT was claimed
SEED = Range(0, 2**32 - 1, says="a whole number from 0 to 2**32 - 1")


@dataclass(frozen=True)
class OnePerItem:
    """Weights: one positive number per item of the list `field` (the sources of a mixture)."""

    field: str

    def problem(self, field: str, weights: list[float], ctx: Context) -> str | None:
        items = ctx.value(self.field) or []
        if len(weights) != len(items):
            return (
                f"{ctx.name(field)} gives {len(weights)} weights for {len(items)} {self.field} sources; give one "
                "per source"
            )
        if not all(math.isfinite(w) and w > 0 for w in weights):
            return f"{ctx.name(field)} {shown(weights)} must be positive numbers; e.g. 2 1 1 gives the first half"
        return None


@dataclass(frozen=True)
class OneOf:
    """A name among the keys of a registry, read when checked (so that an entry made after the settings were declared
    counts; a Literal's choices are fixed when declared); the command line offers them as its choices."""

    registry: Mapping[str, object]

    @property
    def choices(self) -> list[str]:
        return list(self.registry)

    def problem(self, field: str, value, ctx: Context) -> str | None:
        if value in self.registry:
            return None  # said as a Literal's wrong value is (`fields.type_problems`)
        return f"{field} {shown(value)} is not one of {', '.join(self.registry)}; fix the file, option or argument"


@dataclass(frozen=True)
class Excludes:
    """When this field's value meets `when` (by default: it is true), another `field` must be unset (None), the
    two being two ways to ask for one thing: "--start and --prompts both choose how a sample begins; keep one"."""

    field: str
    why: str
    when: Callable[[object], bool] = bool

    def problem(self, field: str, value, ctx: Context) -> str | None:
        if not self.when(value) or ctx.value(self.field) is None:
            return None
        return f"{ctx.name(field)} and {ctx.name(self.field)} {self.why}; keep one"


def _number(bound: float | None) -> str:
    if bound is None:  # no bound on that side: not worded
        return ""
    return f"{bound:,}" if isinstance(bound, int) else f"{bound:g}"
