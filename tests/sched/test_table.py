"""The scheduler's rules are one table (`slices.TABLE`): every move a step
takes is a row of it, and every row is taken by some run here.

As h11 checks HTTP against its transition table: each `SliceScheduler`
records the moves it took (`moves`: state kind, row, state kind); random
runs of the GPU model (`slice_model`) may take none that the table lacks,
and chosen runs together take every row.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from cgpu_km.sched import ContainerSpec, GpuConfig, Observation, Policy, SliceScheduler, slices
from cgpu_km.sched.slices import (
    TABLE,
    Draining,
    Holding,
    Idle,
    Native,
    Row,
    TransitionError,
    transition,
)
from tests.sched.slice_model import Proc, run
from tests.sched.test_slices import CI, Scenario, processes, scenarios

W = ContainerSpec
WAITING = Observation(waiting=True)
KINDS = {kind.__name__: kind for kind in (Idle, Holding, Draining, Native)}
Moves = Mapping[tuple[str, str, str], int]


def in_the_table(move: tuple[str, str, str]) -> bool:
    source, name, target = move
    return any(row.name == name and KINDS[source] in row.source and KINDS[target] in row.targets
               for row in TABLE)


def test_the_rows_have_names_of_their_own() -> None:
    names = [row.name for row in TABLE]
    assert len(set(names)) == len(names)



@settings(max_examples=10 if CI else 200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow],
          phases=(Phase.explicit, Phase.reuse, Phase.generate, *(() if CI else (Phase.shrink,))))
@given(scenarios(), st.sampled_from([0.0, 0.004, 0.015, 0.05]),
       st.sampled_from([0.5, 0.1]))
def test_every_move_of_a_random_run_is_a_row_of_the_table(
        scenario: Scenario, gaps: float, drain_timeout: float) -> None:
    """Busy containers, some of whose demand stops for `gaps` every 20 ms (so
    that they rest, wake, go idle), drains cut at `drain_timeout`."""
    config, _ = scenario
    scheduler = SliceScheduler(config, drain_timeout=drain_timeout)

    def demand(t: float, name: str) -> bool:
        return int(name[1:]) % 2 == 0 or (t * 1000) % 20 >= gaps * 1000

    run(scheduler, processes(scenario), 0.5, demand=demand)
    assert all(in_the_table(move) for move in scheduler.moves), scheduler.moves


def drive(scheduler: SliceScheduler, *steps: tuple[float, Mapping[str, Observation]]) -> Moves:
    for now, observed in steps:
        scheduler.step(now, observed)
    return scheduler.moves


def modelled(config: GpuConfig, procs: list[Proc], duration: float, **kw: object) -> Moves:
    scheduler = SliceScheduler(config)
    run(scheduler, procs, duration, **kw)  # type: ignore[arg-type]
    return scheduler.moves


def chosen_runs() -> list[Moves]:
    weighted = GpuConfig(policy=Policy.WEIGHTED, containers={"a": W(1), "b": W(2)})
    prio = GpuConfig(policy=Policy.PREEMPTIVE,
                     containers={"hi": W(1, highprio=True), "lo": W(1)})
    native = GpuConfig(policy=Policy.NATIVE, containers={"a": W(1, util_limit=30), "b": W(0)})
    back = SliceScheduler(native)
    back.step(0.0, {})
    back.configure(GpuConfig(policy=Policy.WEIGHTED, containers=native.containers))
    return [
        # slices, renewals, drains answered and cut, grants
        modelled(weighted, [Proc(n, 0.1, 2) for n in "ab" for _ in range(4)], 3.0, dt=0.0005),
        # interactive requests beside a busy neighbour: handovers
        modelled(weighted, [Proc("a", 0.001), Proc("b", 0.001, 2, every=0.02,
                                                   next_request=0.005)], 1.0),
        # requests closer together than the idle grace, under policy 2: the holder
        # has said it went idle when the next one wakes
        modelled(GpuConfig(policy=Policy.FIXED, max_inst=4,
                           containers={n: W(1) for n in "abcd"}),
                 [Proc(n, 0.001, 2, every=0.01, next_request=0.0025 * i)
                  for i, n in enumerate("abcd")], 0.5),
        # a busy high-priority container that stops for 4 ms in 20: it comes back
        # unrested, and preempts
        modelled(prio, [Proc("hi", 0.001, 1), Proc("lo", 0.001, 2)], 1.0,
                 demand=lambda t, n: n == "lo" or (t * 1000) % 20 > 4),
        modelled(native, [Proc("a", 0.001), Proc("b", 0.001)], 0.5),
        # a drain waited for, step by step; a lone container out of credit idles
        drive(SliceScheduler(weighted, quantum=0.02),
              (0.0, {"a": WAITING, "b": WAITING}),
              (0.02, {"a": WAITING, "b": Observation(waiting=True, answered=False)}),
              (0.03, {"a": WAITING, "b": Observation(waiting=True, answered=False)})),
        drive(SliceScheduler(GpuConfig(policy=Policy.FIXED, max_inst=4,
                                       containers={"a": W(1)}), quantum=0.02),
              (0.0, {"a": WAITING}), (0.2, {"a": WAITING}),
              (0.2005, {"a": Observation(waiting=True, answered=True)}),
              (0.21, {"a": WAITING})),
        # a holder that closed itself at the end it was told: no drain awaited
        drive(SliceScheduler(weighted, quantum=0.02),
              (0.0, {"a": WAITING, "b": WAITING}),
              (0.021, {"a": WAITING, "b": Observation(waiting=True, closed_itself=True)})),
        # back from policy 5: Idle, then a grant
        drive(back, (0.01, {}), (0.02, {"a": WAITING})),
    ]


def test_every_row_of_the_table_is_taken_by_some_run() -> None:
    taken: Counter[tuple[str, str, str]] = Counter()
    for moves in chosen_runs():
        taken.update(moves)
    assert all(in_the_table(move) for move in taken), taken
    assert {row.name for row in TABLE} == {name for _, name, _ in taken}, taken


def test_a_move_the_table_lacks_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = SliceScheduler(GpuConfig(containers={"a": W(1)}))
    scheduler.step(0.0, {"a": WAITING})
    facts = scheduler._facts(0.01, 0.01, {"a": WAITING}, None)
    with pytest.raises(TransitionError, match="no row"):
        transition(object(), facts)  # type: ignore[arg-type]
    # a row that claims Idle to Holding and moves to Draining
    wrong = Row("wrong", (Idle,), lambda s, f: True, (Holding,),
                lambda s, f: (Draining("a", closed_at=0.0, paid_to=0.0), ()), "always", "none")
    monkeypatch.setitem(transition.__globals__["_ROWS"], Idle, (wrong,))
    with pytest.raises(TransitionError, match="not in the table"):
        transition(Idle(), facts)


def kinds(of: tuple[type, ...], each: str = "{}", between: str = ", ") -> str:
    if set(of) == set(KINDS.values()):
        return "any"
    return between.join(each.format(kind.__name__) for kind in of)


def test_the_developer_docs_show_the_codes_table() -> None:
    """docs/developer/scheduler.md: one line per row, in the table's order."""
    page = (Path(__file__).parents[2] / "docs/developer/scheduler.md").read_text()
    lines = [f"| `{row.name}` | {kinds(row.source, '`{}`')} | {row.when} | "
             f"{kinds(row.targets, '`{}`')} | {row.does} |" for row in TABLE]
    shown = [line for line in page.splitlines() if line in lines]
    assert shown == lines


def test_the_module_docstring_shows_the_codes_table() -> None:
    """slices.py's docstring: row, from, when (continued on the lines below) and to."""
    assert slices.__doc__ is not None
    block = slices.__doc__.split("    row        from")[1].split("\n\n")[0].splitlines()[1:]
    rows: list[list[str]] = []
    for line in block:
        if line.startswith("     "):  # the guard, continued
            rows[-1][2] += " " + line.strip()
        else:
            rows.append(re.split(r"\s{2,}", line.strip()))
    assert rows == [[row.name, kinds(row.source, between="/"), row.when,
                     kinds(row.targets, between="/")] for row in TABLE]
