"""Pure compute scheduler: per-GPU gate decisions from policy, shares and measured GPU time.

One `GateScheduler` per GPU. Every period the daemon calls
`step(now, usage, active)` with each container's cumulative GPU busy time
(seconds, measured, whatever ran past a slice included) and whether it has
work; the answer says which containers' gates are open until the next step.
No I/O and no clock here: time is what the caller passes, so the same code
runs under the daemon, in simulated time in tests, and in the benchmark.

Shares (`allotments`) follow the policy table of ../shared/DESIGN.md:

| policy | share of an eligible container i |
| --- | --- |
| 0 fair-share | ``1/max_inst`` while active, never more |
| 1 preemptive | ``1/N`` of the N active containers |
| 2 weighted | ``w_i / sum(w of all containers)``; idle slices stay idle |
| 3 fixed | ``w_i / max_inst`` |
| 4 soft | ``w_i / sum(w of active containers)`` |
| 5 native | every gate open; only ``util_limit`` still applies |

Decisions made here where the table is silent:

- weight 0 means no compute under policies 0-4 (the container was created
  while no weight was free); under 5 (native) it runs like everyone else.
- An active ``highprio`` container takes ``prio_ratio`` percent (several of
  them split it by weight under 2-4, equally under 0-1; never less than
  their plain policy share). While it has credit it preempts the others
  (their gates close). The rest is shared by the policy: under 1/4 the
  others split the rest by the policy's proportions; under 0/2/3 each
  keeps its plain share when the rest allows, else all are scaled down.
  Under the work-conserving policies (1, 4) time that the high-priority
  group cannot use (``util_limit``) flows to the others and back.
- ``util_limit`` caps a container's share under every policy; under 1 and
  4 what a capped container cannot take is water-filled to the others.

Enforcement is deficit accounting with exact shares. Shares are
`fractions.Fraction` built from the integers in the tree, so 8:4 and 2:1
are the same number. Each container has a share credit (accrues
``share * dt``, pays for the GPU time it really used, so a kernel that runs
past its slice is charged to its owner) and a cap credit for
``util_limit`` (accrues ``cap * dt``, never forgiven). A gate is open while
neither credit is below minus one period's worth of its rate. Positive
credit is clamped to a short burst when the container was idle or left the
GPU idle (no banking). Under the
work-conserving policies what an active container clamps away that way
(credit it had the chance to use and did not) is lent to the other active
containers in proportion to their shares, so a light container's unused
time is not wasted; nothing is forgiven, so busy containers' shares stay exact.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

__all__ = [
    "Allotment",
    "ContainerSpec",
    "GateDecision",
    "GateScheduler",
    "GpuConfig",
    "Policy",
    "allotments",
    "waterfill",
]

ZERO = Fraction(0)
ONE = Fraction(1)


class Policy(enum.IntEnum):
    """The values of a GPU's `policy` node."""

    FAIR_SHARE = 0
    PREEMPTIVE = 1
    WEIGHTED = 2
    FIXED = 3
    SOFT = 4
    NATIVE = 5

    @property
    def work_conserving(self) -> bool:
        return self in (Policy.PREEMPTIVE, Policy.SOFT, Policy.NATIVE)


@dataclass(frozen=True)
class ContainerSpec:
    """One container's scheduling parameters as the tree holds them."""

    weight: int = 1
    highprio: bool = False
    util_limit: int = 0  # percent, 0 = none

    @property
    def limit(self) -> Fraction:
        return Fraction(self.util_limit, 100) if self.util_limit > 0 else ONE


@dataclass(frozen=True)
class GpuConfig:
    """One GPU's policy nodes and its containers."""

    policy: Policy = Policy.PREEMPTIVE
    max_inst: int = 16
    prio_ratio: int = 80
    containers: Mapping[str, ContainerSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Policy(self.policy))
        if self.max_inst < 1:
            raise ValueError(f"max_inst must be at least 1, not {self.max_inst}")
        if not 0 <= self.prio_ratio <= 100:
            raise ValueError(f"prio_ratio must be 0..100, not {self.prio_ratio}")


@dataclass(frozen=True)
class Allotment:
    """Long-run share of GPU time a container is given now, and the cap it may not pass."""

    share: Fraction
    cap: Fraction
    preempts: bool = False


def waterfill(
    total: Fraction, weights: Mapping[str, Fraction], caps: Mapping[str, Fraction]
) -> dict[str, Fraction]:
    """Split `total` in proportion to `weights`, nobody above their cap; exact.

    What the capped ones cannot take goes to the others in proportion to
    their weights. The result sums to `total` unless every receiver is capped.
    """
    result = {name: ZERO for name in weights}
    left = {name for name, w in weights.items() if w > 0}
    remaining = total
    while left and remaining > 0:
        weight_sum = sum((weights[n] for n in left), ZERO)
        level = remaining / weight_sum
        capped = {n for n in left if weights[n] * level >= caps[n]}
        if not capped:
            for n in left:
                result[n] = weights[n] * level
            break
        for n in capped:
            result[n] = caps[n]
            remaining -= caps[n]
        left -= capped
    return result


def _policy_weight(policy: Policy, spec: ContainerSpec) -> Fraction:
    """Relative weight inside a group: the weight under 2-4, equal under 0-1."""
    if policy in (Policy.FAIR_SHARE, Policy.PREEMPTIVE):
        return ONE
    return Fraction(spec.weight)


def _plain_shares(config: GpuConfig, eligible: Set[str], active: Set[str]) -> dict[str, Fraction]:
    """The policy table without priority or limits (non-work-conserving policies)."""
    specs = config.containers
    if config.policy is Policy.FAIR_SHARE:
        return {n: Fraction(1, config.max_inst) for n in eligible}
    if config.policy is Policy.FIXED:
        return {n: Fraction(specs[n].weight, config.max_inst) for n in eligible}
    # WEIGHTED: every container's weight counts, active or not.
    total = sum(specs[n].weight for n in eligible)
    return {n: Fraction(specs[n].weight, total) for n in eligible}


def allotments(config: GpuConfig, active: Set[str]) -> dict[str, Allotment]:
    """Share and cap of every container of `config`, given which ones are active."""
    specs = config.containers
    policy = config.policy
    if policy is Policy.NATIVE:
        return {n: Allotment(share=s.limit, cap=s.limit) for n, s in specs.items()}

    eligible = {n for n, s in specs.items() if s.weight > 0}
    runnable = eligible & set(active)
    prio = {n for n in runnable if specs[n].highprio}
    others = eligible - prio
    p = Fraction(config.prio_ratio, 100) if prio else ZERO
    limits = {n: specs[n].limit for n in specs}
    pweight = {n: _policy_weight(policy, specs[n]) for n in eligible}
    shares: dict[str, Fraction] = {n: ZERO for n in specs}

    if policy.work_conserving:
        prio_w = {n: pweight[n] for n in prio}
        other_w = {n: pweight[n] for n in others & runnable}
        got_prio = waterfill(p, prio_w, limits)
        got_other = waterfill(ONE - sum(got_prio.values(), ZERO), other_w, limits)
        got_prio = waterfill(ONE - sum(got_other.values(), ZERO), prio_w, limits)
        shares.update(got_prio)
        shares.update(got_other)
    else:
        plain = _plain_shares(config, eligible, runnable)
        if prio:
            prio_total = max(p, sum((plain[n] for n in prio), ZERO))
            prio_w_sum = sum((pweight[n] for n in prio), ZERO)
            for n in prio:
                shares[n] = prio_total * pweight[n] / prio_w_sum
            rest = ONE - prio_total
            reserved = sum((plain[n] for n in others), ZERO)
            scale = min(ONE, rest / reserved) if reserved > 0 else ONE
            for n in others:
                shares[n] = plain[n] * scale
        else:
            shares.update(plain)
        shares = {n: min(s, limits[n]) for n, s in shares.items()}

    return {
        n: Allotment(share=shares[n], cap=limits[n], preempts=n in prio) for n in specs
    }


@dataclass(frozen=True)
class GateDecision:
    """Which gates are open until the next step, and why (for metrics and tests)."""

    open: frozenset[str]
    shares: Mapping[str, Fraction]
    slack: bool  # the GPU went idle during the last period

    def is_open(self, name: str) -> bool:
        return name in self.open


@dataclass
class _Account:
    credit: float = 0.0
    cap_credit: float = 0.0
    last_usage: float | None = None


class GateScheduler:
    """Deficit-accounting gate scheduler for one GPU (pure, driven by `step`)."""

    def __init__(
        self,
        config: GpuConfig,
        *,
        period: float = 0.02,
        burst_periods: float = 5.0,
        slack_fraction: float = 0.1,
    ) -> None:
        if period <= 0:
            raise ValueError(f"period must be positive, not {period}")
        self.period = period
        self.burst_window = period * burst_periods
        self.slack_fraction = slack_fraction
        self._config = config
        self._accounts: dict[str, _Account] = {n: _Account() for n in config.containers}
        self._now: float | None = None
        self._active: frozenset[str] = frozenset()
        self._set_allot()

    @property
    def config(self) -> GpuConfig:
        return self._config

    def configure(self, config: GpuConfig) -> None:
        """Apply a new configuration; it takes effect at the next step.

        Containers keep their credit unless the policy changed (then every
        account starts afresh so that the new policy holds at once).
        """
        fresh = config.policy != self._config.policy
        accounts: dict[str, _Account] = {}
        for name in config.containers:
            old = self._accounts.get(name)
            if old is None:
                accounts[name] = _Account()
            elif fresh:
                accounts[name] = _Account(last_usage=old.last_usage)
            else:
                accounts[name] = old
        self._accounts = accounts
        self._config = config
        self._active = self._active & frozenset(config.containers)
        self._set_allot()

    def credits(self) -> dict[str, float]:
        """Share credit per container in seconds (negative: owes GPU time)."""
        return {n: a.credit for n, a in self._accounts.items()}

    def step(
        self, now: float, usage: Mapping[str, float], active: Set[str]
    ) -> GateDecision:
        """Charge the GPU time used since the last step and decide the gates.

        `usage`: cumulative GPU busy seconds per container (monotone; a
        container missing from it used nothing; a value that went down is
        taken as a new baseline). `active`: containers that have work.
        """
        dt = 0.0 if self._now is None else now - self._now
        if dt < 0:
            raise ValueError(f"time went backwards: {now} < {self._now}")
        self._now = now

        used: dict[str, float] = {}
        for name, acc in self._accounts.items():
            value = usage.get(name)
            if value is None:
                used[name] = 0.0
                continue
            last = acc.last_usage
            used[name] = value - last if last is not None and value >= last else 0.0
            acc.last_usage = value
        busy = sum(used.values())
        slack = dt > 0 and busy < dt * (1.0 - self.slack_fraction)
        lend = self._config.policy.work_conserving

        unused = 0.0
        for name, acc in self._accounts.items():
            share, cap = self._rates[name]
            acc.credit += share * dt - used[name]
            acc.cap_credit += cap * dt - used[name]
            if slack or name not in self._active:
                # It had the chance (the GPU went idle) or no work: no banking.
                burst = share * self.burst_window
                if acc.credit > burst:
                    if name in self._active:
                        unused += acc.credit - burst
                    acc.credit = burst
                acc.cap_credit = min(acc.cap_credit, cap * self.burst_window)
        if lend and unused > 0:
            self._lend(unused)

        active_now = frozenset(active) & frozenset(self._config.containers)
        if active_now != self._active:
            self._active = active_now
            self._set_allot()
        return GateDecision(open=self._decide(slack), shares=self._shares, slack=slack)

    def _set_allot(self) -> None:
        """Recompute the allotments (exact) and their float rates for the accounting."""
        self._allot = allotments(self._config, self._active)
        self._shares: dict[str, Fraction] = {n: a.share for n, a in self._allot.items()}
        self._rates: dict[str, tuple[float, float]] = {
            n: (float(a.share), float(a.cap)) for n, a in self._allot.items()
        }

    def _lend(self, unused: float) -> None:
        """Work conservation: credit that active containers left unused goes to the others."""
        takers = {
            n: self._rates[n][0] for n in self._active
            if self._rates[n][0] > 0
            and self._accounts[n].credit < self._rates[n][0] * self.burst_window
        }
        total = sum(takers.values())
        for name, share in takers.items():
            self._accounts[name].credit += unused * share / total

    def _decide(self, slack: bool) -> frozenset[str]:
        if self._config.policy is Policy.NATIVE:
            return frozenset(
                n for n, acc in self._accounts.items()
                if self._allot[n].cap >= 1 or acc.cap_credit >= 0
            )
        # A gate stays open down to one period's worth of debt: measurements
        # jitter against the caller's clock, and closing a lone busy container
        # for a whole period over a few microseconds would waste the GPU. This
        # is an offset of the credit, not a rate: long-run shares are the same.
        open_ = {
            n for n, acc in self._accounts.items()
            if self._rates[n][0] > 0
            and acc.credit >= -self._rates[n][0] * self.period
            and acc.cap_credit >= -self._rates[n][1] * self.period
        }
        if self._config.policy.work_conserving:
            # An idle container keeps its gate open while it owes nothing, so that
            # its first launch does not wait a period; it is charged as usual and
            # becomes active (with its share) at the next step.
            open_ |= {
                n for n, acc in self._accounts.items()
                if n not in self._active and self._config.containers[n].weight > 0
                and acc.credit >= 0 and acc.cap_credit >= 0
            }
        preempting = {n for n in open_ if self._allot[n].preempts and n in self._active}
        if preempting and not slack:
            return frozenset(preempting)
        return frozenset(open_)

    # -- state kept across a daemon restart or hot update -------------------

    def to_state(self) -> dict[str, Any]:
        """JSON-serialisable accounting state (credits and usage baselines)."""
        return {
            "now": self._now,
            "active": sorted(self._active),
            "accounts": {
                n: {"credit": a.credit, "cap_credit": a.cap_credit, "last_usage": a.last_usage}
                for n, a in self._accounts.items()
            },
        }

    def restore(self, state: Mapping[str, Any]) -> None:
        """Take back what `to_state` produced; unknown containers are ignored.

        The clock baseline is not restored: the caller's clock may differ
        (a new process), so the first step after a restore charges nothing.
        """
        for name, saved in dict(state.get("accounts", {})).items():
            acc = self._accounts.get(name)
            if acc is None:
                continue
            acc.credit = float(saved.get("credit", 0.0))
            acc.cap_credit = float(saved.get("cap_credit", 0.0))
            last = saved.get("last_usage")
            acc.last_usage = None if last is None else float(last)
        self._active = frozenset(state.get("active", ())) & frozenset(self._config.containers)
        self._set_allot()
