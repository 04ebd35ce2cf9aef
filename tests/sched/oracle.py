"""Expected shares, worked out apart from the code under test.

`busy_shares(config)` is the part of the GPU each container gets when every one
of them is busy, from the policy table and the rules of docs/design.md
("Scheduling policies"), in floats and with water filling done the textbook
way (the smallest caps first), so that it shares no code and no arithmetic
with `cgpu_km.sched.allotments`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cgpu_km.sched import GpuConfig, Policy


def water_fill(amount: float, weights: Mapping[str, float], caps: Mapping[str, float],
               names: Sequence[str]) -> dict[str, float]:
    """Split `amount` among `names` in proportion to their weights, none above its cap;
    what a capped one leaves goes to the others."""
    got = dict.fromkeys(names, 0.0)
    order = sorted((n for n in names if weights[n] > 0), key=lambda n: caps[n] / weights[n])
    left, weight_left = amount, sum(weights[n] for n in order)
    for n in order:
        fair = left * weights[n] / weight_left
        got[n] = min(fair, caps[n])
        left -= got[n]
        weight_left -= weights[n]
    return got


def busy_shares(config: GpuConfig) -> dict[str, float]:
    """Each container's share of GPU time under policies 0 to 4, every container busy."""
    specs, policy = config.containers, config.policy
    live = [n for n, s in specs.items() if s.weight > 0]  # weight 0: no compute
    caps = {n: s.util_limit / 100 if s.util_limit else 1.0 for n, s in specs.items()}
    # Inside the high-priority group and among the rest: equal under 0 and 1,
    # by weight under 2 to 4.
    equal = policy in (Policy.FAIR_SHARE, Policy.PREEMPTIVE)
    weights = {n: 1.0 if equal else float(specs[n].weight) for n in live}
    prio = [n for n in live if specs[n].highprio]
    rest = [n for n in live if n not in prio]
    ratio = config.prio_ratio / 100 if prio else 0.0
    shares = dict.fromkeys(specs, 0.0)

    if policy in (Policy.PREEMPTIVE, Policy.SOFT):  # the whole GPU is handed out
        shares.update(water_fill(ratio, weights, caps, prio))
        shares.update(water_fill(1 - sum(shares[n] for n in prio), weights, caps, rest))
        # What the others cannot take goes back to the high-priority group.
        shares.update(water_fill(1 - sum(shares[n] for n in rest), weights, caps, prio))
        return shares

    if policy is Policy.FAIR_SHARE:
        plain = {n: 1 / config.max_inst for n in live}
    elif policy is Policy.FIXED:
        plain = {n: specs[n].weight / config.max_inst for n in live}
    else:  # weighted: every container's weight counts
        plain = {n: specs[n].weight / sum(specs[m].weight for m in live) for n in live}
    shares.update(plain)
    if prio:
        group = max(ratio, sum(plain[n] for n in prio))
        for n in prio:
            shares[n] = group * weights[n] / sum(weights[m] for m in prio)
        asked = sum(plain[n] for n in rest)
        scale = min(1.0, (1 - group) / asked) if asked else 1.0
        for n in rest:
            shares[n] = plain[n] * scale
    return {n: min(share, caps[n]) for n, share in shares.items()}
