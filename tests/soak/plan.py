"""What the soak does when: a pure function of a seed.

`make_plan(seed, seconds, gpus)` gives every event of a soak run, in time
order (seconds from its start):

- `Pair`: on every GPU two long-running workloads with weights, whose
  kernel counts are the shares the soak judges; a pair at 0 (started before
  the soak's clock), and a new one after each restart of cgpu-fuse (which
  forgets every registration);
- `Start`: a churn container (Docker or runc) with a seeded configuration:
  cGPU or eGPU memory, weight, highprio, a cap, how long it lives and what
  its workload launches; it probes its limit first;
- `Write`: a live write to the control tree (a pair's weight, a GPU's
  policy or max_inst, a churn container's memsize);
- `Fault`: one of `FAULTS`, spaced evenly, kinds taken in a seeded order,
  each round of them ending with cgpu-fuse's restart (whose new pair takes a
  while to start).

Nothing here runs anything: the runner (`tests.soak.runner`) executes the plan.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

MIB = 1 << 20
T4 = 15109 * MIB  # simgpu's Tesla T4
EGPU_RESERVE = 10 * MIB  # ALIYUN_COM_GPU_MEM_RESERVED's default, eGPU only
ENGINES = ("docker", "runc")
FAULTS = ("daemon-kill", "upgrade", "fuse-kill", "launch-kill", "oom-hang", "bypass")
SHARE_POLICIES = (1, 2, 4)  # policies whose share of a pair is a ratio of its weights
INITIAL_POLICY = 2  # the soak writes it on every GPU at the start and after a remount
PAIR_DELAY = 3.0  # after a cgpu-fuse restart, before the next pair
FIRST_START = 2.0  # churn and writes begin once the pairs run
MAX_FAULT_SPACING = 30.0


@dataclass(frozen=True)
class Pair:
    """Two workloads per GPU, with these weights (GPU -> (w1, w2)), until `until`."""

    at: float
    until: float
    weights: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Container:
    """A churn container's configuration and what its probe expects."""

    engine: str
    gpu: int
    env: tuple[tuple[str, str], ...]
    limit: int  # bytes: cuMemGetInfo's total inside, and the most one allocation gets
    lifetime: float  # seconds from its start to its stop
    kernels: int  # its workload's kernels
    us: int  # each kernel's length


@dataclass(frozen=True)
class Start:
    at: float
    number: int
    container: Container


@dataclass(frozen=True)
class Write:
    """`echo VALUE > TREE/GPU/NODE` (NODE `memsize`: of a live churn container,
    the `pick`th modulo how many run on that GPU then)."""

    at: float
    gpu: int
    node: str  # weight1, weight2 (a pair's), policy, max_inst, memsize
    value: int
    pick: int = 0


@dataclass(frozen=True)
class Fault:
    at: float
    kind: str
    gpu: int  # where its container runs (launch-kill, oom-hang, bypass)


Event = Pair | Start | Write | Fault


def cgpu_env(rng: random.Random) -> tuple[tuple[tuple[str, str], ...], int]:
    """A cGPU container's memory variables and its limit: c of 15 parts."""
    parts = rng.randint(1, 4)
    env = (("ALIYUN_COM_GPU_MEM_CONTAINER", str(parts)), ("ALIYUN_COM_GPU_MEM_DEV", "15"))
    return env, T4 * parts // 15


def egpu_env(rng: random.Random) -> tuple[tuple[tuple[str, str], ...], int]:
    """An eGPU container's memory variables and its limit (less the reserve)."""
    size = rng.randrange(256, 4096, 64) * MIB
    env = (("AMP_VGPU_ENABLE", "1"), ("GPU_MEM_PER_DEVICE", str(size)))
    return env, size - EGPU_RESERVE


def container(rng: random.Random, gpus: int) -> Container:
    """A churn container: a seeded engine, GPU, memory, weight, priority and cap."""
    engine = rng.choice(ENGINES)
    gpu = rng.randrange(gpus)
    env, limit = (cgpu_env if rng.random() < 0.6 else egpu_env)(rng)
    extra = [("ALIYUN_COM_GPU_SCHD_WEIGHT", str(rng.randint(1, 3)))]
    if rng.random() < 0.1:
        extra.append(("ALIYUN_COM_GPU_HIGH_PRIO", "1"))
    if rng.random() < 0.2:
        extra.append(("GPU_UTIL_PER_DEVICE", str(rng.randrange(10, 70, 10))))
    return Container(engine, gpu, (*env, *extra), limit, lifetime=rng.uniform(4.0, 12.0),
                     kernels=rng.randrange(100, 600, 50), us=rng.choice((500, 1000, 2000)))


def write(rng: random.Random, at: float, gpus: int) -> Write:
    gpu = rng.randrange(gpus)
    node = rng.choice(("weight1", "weight2", "policy", "max_inst", "memsize"))
    if node in ("weight1", "weight2"):
        value = rng.randint(1, 4)
    elif node == "policy":
        value = rng.choice(SHARE_POLICIES)
    elif node == "max_inst":
        value = rng.choice((12, 16, 20))
    else:
        value = rng.randrange(4096, 8192, 256) * MIB
    return Write(at, gpu, node, value, pick=rng.randrange(1 << 16))


def fault_times(seconds: float) -> list[float]:
    """Evenly spaced: every kind once in a short run, at most `MAX_FAULT_SPACING` apart."""
    spacing = min(MAX_FAULT_SPACING, seconds / (len(FAULTS) + 1))
    count = int(seconds / spacing - 0.5)
    return [round(spacing * (k + 1), 3) for k in range(count)]


def make_plan(seed: int, seconds: float, gpus: int = 8, *, churn_every: float = 2.0,
              write_every: float = 5.0) -> list[Event]:
    """Every event of a `seconds` soak on `gpus` GPUs, in time order."""
    rng = random.Random(seed)
    order = [kind for kind in FAULTS if kind != "fuse-kill"]
    rng.shuffle(order)
    order.append("fuse-kill")
    faults = [Fault(at, order[k % len(order)], rng.randrange(gpus))
              for k, at in enumerate(fault_times(seconds))]
    pair_starts = sorted({0.0, *(f.at + PAIR_DELAY for f in faults if f.kind == "fuse-kill")})
    pair_starts = [at for at in pair_starts if at < seconds - 1]
    ends = [*pair_starts[1:], seconds]
    events: list[Event] = [
        Pair(at, until, tuple((rng.randint(1, 3), rng.randint(1, 3)) for _ in range(gpus)))
        for at, until in zip(pair_starts, ends, strict=True)]
    events += faults
    at, number = FIRST_START, 0
    while at < seconds - 2:
        events.append(Start(round(at, 3), number, container(rng, gpus)))
        number += 1
        at += rng.expovariate(1 / churn_every)
    at = FIRST_START + rng.uniform(0, write_every)
    while at < seconds - 1:
        events.append(write(rng, round(at, 3), gpus))
        at += rng.uniform(0.5, 1.5) * write_every
    return sorted(events, key=lambda e: (e.at, type(e).__name__))


def ratio_at(events: Sequence[Event], gpu: int, at: float) -> float | None:
    """The ratio w2/w1 that GPU `gpu`'s pair should complete at time `at` by the policy
    and weights the plan wrote before it; None when no pair runs then."""
    pairs = [e for e in events if isinstance(e, Pair) and e.at <= at < e.until]
    if not pairs:
        return None
    pair = pairs[-1]
    w1, w2 = pair.weights[gpu]
    policy = INITIAL_POLICY
    for event in events:
        if event.at > at:
            break
        if isinstance(event, Write) and event.gpu == gpu:
            if event.node == "policy":
                policy = event.value
            elif event.node == "weight1" and event.at >= pair.at:
                w1 = event.value
            elif event.node == "weight2" and event.at >= pair.at:
                w2 = event.value
    return 1.0 if policy == 1 else w2 / w1
