"""Shares: what part of a GPU each container is owed, from its policy and the tree (pure).

`allotments` follows the policy table of docs/design.md:

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
  their plain share). While it has credit it preempts the others: a slice
  of another container ends as soon as it waits. The rest is shared by the
  policy: under 1/4 the others split the rest by the policy's proportions;
  under 0/2/3 each keeps its plain share when the rest allows, else all are
  scaled down. Under the work-conserving policies (1, 4) time that the
  high-priority group cannot use (``util_limit``) flows to the others.
- ``util_limit`` caps a container's share under every policy; under 1 and
  4 what a capped container cannot take is water-filled to the others.
  Under 5 it is a duty cycle: the gate of a capped container is open for at
  most that part of the time it is active.

Shares are `fractions.Fraction` built from the integers in the tree, so 8:4 and
2:1 are the same number.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from fractions import Fraction

__all__ = ["Allotment", "ContainerSpec", "GpuConfig", "Policy", "allotments", "waterfill"]

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
