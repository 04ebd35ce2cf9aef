"""A soak run's summary (pure, from its `Record`), and its table, CSV and plot."""

from __future__ import annotations

import collections
import csv
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tests.soak import figures
from tests.soak.plan import FAULTS, Event, Pair, Write, ratio_at
from tests.soak.runner import PAIR_US, PairRun, Record

WARMUP = 10.0  # seconds of a daemon's start left out of its growth fit
# The shortest steady window: at a share of a few tenths, a second or more of GPU
# time in 4 s (and a window judged needs figures.RESOLVING of it).
SHORTEST = 4.0


@dataclass
class FaultFigures:
    kind: str
    count: int = 0
    done: list[float] = field(default_factory=list)  # seconds the fault itself took
    recovered: list[float | None] = field(default_factory=list)  # per fault: median GPU
    stalls: list[float] = field(default_factory=list)
    lost: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class Summary:
    seconds: float
    started: dict[str, int]
    refused: list[str]
    probed: int
    held: int
    broken: list[str]  # probes whose limit did not hold
    kernels: int
    writes: int
    writes_refused: int
    rss_kib: tuple[int, int]  # first, last
    rss_growth: float | None  # KiB per hour
    fds: tuple[int, int]
    fds_growth: float | None  # per hour
    rss_peaks: list[tuple[float, float]]  # each daemon life's highest (hours, KiB)
    fds_peaks: list[tuple[float, float]]
    windows: list[figures.Window]
    faults: dict[str, FaultFigures]
    leftovers: dict[str, list[str]]
    errors: list[tuple[float, str]]
    warnings: int
    hook_errors: list[str]

    audits: int = 0  # of honest containers: no bypass fault under way

    @property
    def judged(self) -> list[figures.Window]:
        return [w for w in self.windows if not w.unjudged]

    @property
    def windows_held(self) -> int:
        return sum(1 for w in self.judged if w.held)

    @property
    def lost(self) -> int:
        return sum(f.lost for f in self.faults.values())


def expected_of(applied: Sequence[Event], gpu: int) -> Callable[[float], float | None]:
    events = sorted(applied, key=lambda e: e.at)
    return lambda t: ratio_at(events, gpu, t)


def quiet_of(record: Record, run: PairRun) -> Callable[[float, float], bool]:
    """Whether [start, end] is steady for `run`'s GPU: no fault, restart, write of its
    GPU's policy or weights, or churn container of its GPU arriving or leaving near, and
    both of its containers registered throughout."""
    busy = [(f.at - 0.5, (f.done if f.done is not None else f.at + 30) + figures.SETTLE)
            for f in record.faults]
    busy += [(e.at - 0.5, e.at + figures.SETTLE) for e in record.applied
             if isinstance(e, Write) and e.gpu == run.gpu
             and e.node in ("policy", "weight1", "weight2")]
    busy += [(e.at - 0.5, e.at + figures.SETTLE) for e in record.applied if isinstance(e, Pair)]
    # A churn container's arrival or departure on the GPU (registered up to a couple of
    # seconds before its engine's start returns, unregistered before its removal does).
    busy += [(t - 2.0, t + figures.CHURN_SETTLE) for p in record.probes if p.gpu == run.gpu
             for t in (p.started, p.stopped) if t is not None]

    def quiet(start: float, end: float) -> bool:
        if any(a < end and start < b for a, b in busy):
            return False
        seen = [ok for t, ok in run.registered if start - 0.5 <= t <= end + 0.5]
        return bool(seen) and all(seen)
    return quiet


def summarize(record: Record, shortest: float = SHORTEST) -> Summary:
    """The run's figures; steady windows of at least `shortest` s are judged."""
    probes = [p for p in record.probes if p.started is not None]
    # Probed: both answers came (a container stopped by a fault may not get that far).
    probed = [p for p in probes if p.total is not None and p.over_refused is not None]
    broken = [f"#{p.number} {p.engine} GPU {p.gpu}: total {p.total} of {p.expected}, "
              f"limit+1 {'refused' if p.over_refused else 'GRANTED'}"
              for p in probed if p.total != p.expected or not p.over_refused]
    started = {engine: sum(1 for p in probes if p.engine == engine)
               for engine in ("docker", "runc")}
    refused = [f"#{p.number} {p.engine}: {p.error}" for p in record.probes if p.started is None]
    restarts = [f.at for f in record.faults if f.kind in ("daemon-kill", "upgrade")]
    samples = [s for s in record.samples if s.daemon_pid]
    marks = figures.segments([s.at for s in samples], restarts, WARMUP)
    rss = [(s.at / 3600, float(s.rss_kib), m) for s, m in zip(samples, marks, strict=True)
           if m is not None]
    fds = [(s.at / 3600, float(s.fds), m) for s, m in zip(samples, marks, strict=True)
           if m is not None]
    lines = figures.timed_lines(record.daemon_log, [(s.at, s.log_bytes)
                                                    for s in record.samples])
    windows: list[figures.Window] = []
    for run in record.pairs:
        if run.first is None or run.second is None:
            continue
        windows += figures.steady_windows(
            run.first, run.second, run.gpu, record.t0, (run.at + 1, run.until),
            shortest, quiet_of(record, run), expected_of(record.applied, run.gpu))
    faults = {kind: FaultFigures(kind) for kind in FAULTS}
    ordered = sorted(record.faults, key=lambda f: f.at)
    for k, fault in enumerate(ordered):
        got = faults[fault.kind]
        got.count += 1
        trigger = fault.trigger if fault.trigger is not None else fault.at
        if fault.done is not None:
            got.done.append(round(fault.done - trigger, 3))
        if fault.note:
            got.notes.append(fault.note)
        got.lost += len(fault.lost)
        until = ordered[k + 1].at if k + 1 < len(ordered) else record.seconds
        backs: list[float | None] = []
        for run in record.pairs:
            if run.first is None or run.second is None or not run.at <= trigger < run.until:
                continue
            got.stalls.append(figures.stall(run.first, run.second, record.t0, trigger))
            back = figures.recovery(run.first, run.second, record.t0, trigger,
                                    min(until, run.until), expected_of(record.applied, run.gpu))
            backs.append(back)
        if backs:
            got.recovered.append(median_or_never(backs))
    windows = [explained(w, record, lines) for w in windows]
    bypasses = [(f.at, (f.done if f.done is not None else f.at + 30) + figures.SETTLE)
                for f in record.faults if f.kind == "bypass"]
    audits = sum(1 for at, line in lines if figures.AUDITED.search(line)
                 and not any(a <= at <= b for a, b in bypasses))
    errors = figures.unexplained_errors(lines, [(f.kind, f.at) for f in record.faults])
    warnings = sum(1 for _, line in lines if line.startswith("cgpu-daemon: WARNING: "))
    applied = [w for w, error in record.writes if not error]
    return Summary(
        seconds=record.seconds, started=started, refused=refused, probed=len(probed),
        held=len(probed) - len(broken), broken=broken, kernels=sum(p.kernels for p in probes),
        writes=len(applied), writes_refused=sum(1 for _, e in record.writes
                                                if e and not e.startswith("skipped")),
        rss_kib=(samples[0].rss_kib, samples[-1].rss_kib) if samples else (0, 0),
        rss_growth=figures.fit_slope(rss), fds=(samples[0].fds, samples[-1].fds)
        if samples else (0, 0), fds_growth=figures.fit_slope(fds), windows=windows,
        rss_peaks=figures.peaks(rss), fds_peaks=figures.peaks(fds),
        faults=faults, leftovers=record.leftovers, errors=errors, warnings=warnings,
        hook_errors=record.hook_errors, audits=audits)


def explained(window: figures.Window, record: Record, lines: Sequence[tuple[float, str]]
              ) -> figures.Window:
    """The window with what may explain a miss: the audits on its GPU, and how late its
    dispatcher woke."""
    end = window.start + window.seconds
    samples = [(s.at, s.daemon_pid, *s.late[window.gpu]) for s in record.samples
               if window.gpu in s.late]
    return replace(window, audits=figures.audits(lines, window.gpu, window.start, end),
                   late_ms=figures.mean_lateness(samples, window.start, end),
                   kernel=PAIR_US / 1e6)


def median_or_never(values: Sequence[float | None]) -> float | None:
    """The median, where never (None) counts as longer than any time."""
    ordered = sorted(values, key=lambda v: math.inf if v is None else v)
    return ordered[(len(ordered) - 1) // 2]


def seconds_text(values: Sequence[float | None]) -> str:
    if not values:
        return "-"
    known = [v for v in values if v is not None]
    never = len(values) - len(known)
    text = f"{statistics.median(known):.1f} / {max(known):.1f}" if known else "never"
    return text + (f" ({never} never)" if known and never else "")


def table(s: Summary) -> str:
    """The run's figures, each with its target."""
    left = {k: len(v) for k, v in s.leftovers.items()}
    worst = max((abs(w.error) for w in s.judged), default=0.0)
    shown = collections.Counter(w.unjudged for w in s.windows if w.unjudged)
    pooled = list(figures.pooled(s.windows).values())
    pooled_worst = max((abs(e) for e in pooled), default=0.0)
    rows = [
        ("run", f"{s.seconds:g} s", ""),
        ("containers started (docker / runc)",
         f"{s.started['docker']} / {s.started['runc']}", ""),
        ("starts refused", f"{len(s.refused)}", "explained by a fault or a full GPU"),
        ("probes: limit held", f"{s.held} of {s.probed}", "all"),
        ("churn kernels counted", f"{s.kernels}", ""),
        ("live writes (refused)", f"{s.writes} ({s.writes_refused})", ""),
        ("daemon RSS first / last", f"{s.rss_kib[0] / 1024:.1f} / {s.rss_kib[1] / 1024:.1f} MiB",
         ""),
        ("daemon RSS growth", growth(s.rss_growth, "MiB", 1024), "fitted, least squares"),
        ("daemon fds first / last", f"{s.fds[0]} / {s.fds[1]}", ""),
        ("daemon fds growth", growth(s.fds_growth, "fds", 1), "fitted, least squares"),
        ("daemon RSS peak of each life", lives(s.rss_peaks, "MiB", 1024), "no rise"),
        ("daemon fds peak of each life", lives(s.fds_peaks, "fds", 1), "no rise"),
        ("steady windows within 5%", f"{s.windows_held} of {len(s.judged)} "
         f"(worst {100 * worst:.1f}%; {sum(w.seconds for w in s.judged):.0f} s)", "all"),
        ("  shown, not judged", "; ".join(f"{n} with {why}" for why, n in shown.items())
         or "none", ""),
        ("the same, pooled by GPU and ratio", f"{sum(1 for e in pooled if abs(e) <= 0.05)} "
         f"of {len(pooled)} (worst {100 * pooled_worst:.1f}%)", "all"),
        ("audits of honest containers", f"{s.audits}", "none"),
        ("containers lost after restarts", f"{s.lost}", "none"),
        ("unexplained error lines", f"{len(s.errors)} ({s.warnings} warnings)", "none"),
        ("hook errors when runc stopped one", f"{len(s.hook_errors)}", "none"),
        ("leftovers", ", ".join(f"{k} {v}" for k, v in left.items()), "none"),
    ]
    width = max(len(r[0]) for r in rows)
    out = [f"{name:<{width}} | {value:<34} | {target}" for name, value, target in rows]
    out.append("")
    head = (f"{'fault':<12} | {'n':>2} | {'fault took s':>12} | {'GPUs back s, med / max':>26} | "
            f"{'stall max s':>11} | lost")
    out += [head, "-" * len(head)]
    for f in s.faults.values():
        out.append(f"{f.kind:<12} | {f.count:>2} | {seconds_text(f.done):>12} | "
                   f"{seconds_text(f.recovered):>26} | "
                   f"{(f'{max(f.stalls):.2f}' if f.stalls else '-'):>11} | {f.lost}")
    return "\n".join(out)


def growth(slope: float | None, unit: str, scale: float) -> str:
    return "-" if slope is None else f"{slope / scale:+.2f} {unit}/h"


def write_csv(record: Record, path: Path) -> None:
    """One row a second: the daemon's RSS and fds, registrations, regions, and each
    GPU's share of its pair's second workload (kernels) against the policy's."""
    gpus = range(record.gpus)
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["t", "daemon_pid", "rss_kib", "fds", "registered", "regions",
                         *(f"gpu{g}_share" for g in gpus), *(f"gpu{g}_expected" for g in gpus),
                         "fault"])
        for sample in record.samples:
            shares, expected = shares_at(record, sample.at)
            faults = [f.kind for f in record.faults if sample.at - 1 < f.at <= sample.at]
            writer.writerow([f"{sample.at:.1f}", sample.daemon_pid, sample.rss_kib, sample.fds,
                             sample.registered, sample.regions,
                             *(fmt(shares.get(g)) for g in gpus),
                             *(fmt(expected.get(g)) for g in gpus), " ".join(faults)])


def write_probes(record: Record, path: Path) -> None:
    """One row a churn container: its configuration's limit, what its probe found."""
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["number", "engine", "gpu", "id12", "started", "stopped", "expected",
                         "total", "over_refused", "kernels", "error"])
        for p in sorted(record.probes, key=lambda p: p.number):
            writer.writerow([p.number, p.engine, p.gpu, p.id12, fmt(p.started),
                             fmt(p.stopped), p.expected, p.total, p.over_refused, p.kernels,
                             p.error])


def lives(peaks: Sequence[tuple[float, float]], unit: str, scale: float) -> str:
    """First, highest and last of the peaks, and their slope across the lives."""
    if not peaks:
        return "-"
    values = [y / scale for _, y in peaks]
    slope = figures.fit_slope([(t, y, 0) for t, y in peaks])
    fitted = f"; {slope / scale:+.2f} {unit}/h across them" if slope is not None else ""
    return (f"{values[0]:.1f} / {max(values):.1f} / {values[-1]:.1f} {unit} "
            f"({len(peaks)} lives){fitted}")


def write_windows(summary: Summary, path: Path) -> None:
    """One row a steady window: where, how long, the policy's ratio and the counted one."""
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["gpu", "start", "seconds", "expected", "error", "first_kernels",
                         "second_kernels", "audits", "late_ms", "not_judged"])
        for w in sorted(summary.windows, key=lambda w: (w.gpu, w.start)):
            writer.writerow([w.gpu, f"{w.start:.2f}", f"{w.seconds:.2f}", f"{w.expected:.4f}",
                             f"{w.error:.4f}", *w.kernels, w.audits, fmt(w.late_ms),
                             w.unjudged])


def fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def shares_at(record: Record, at: float) -> tuple[dict[int, float], dict[int, float]]:
    """Each GPU's second-workload share in the second before `at`, and the policy's."""
    shares: dict[int, float] = {}
    expected: dict[int, float] = {}
    for run in record.pairs:
        if run.first is None or run.second is None or not run.at + 1 <= at <= run.until:
            continue
        a, b = record.t0 + at - 1, record.t0 + at
        one, two = figures.count(run.first, a, b), figures.count(run.second, a, b)
        if one + two:
            shares[run.gpu] = two / (one + two)
        ratio = expected_of(record.applied, run.gpu)(at)
        if ratio is not None:
            expected[run.gpu] = ratio / (1 + ratio)
    return shares, expected


def plot(record: Record, path: Path) -> str:
    """The PNG: each GPU's share and the daemon's RSS over time, faults marked; or why not."""
    try:
        import matplotlib
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install '.[bench]')"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [s.at for s in record.samples]
    rows = [shares_at(record, t) for t in times]
    figure, axes = plt.subplots(record.gpus + 1, 1, sharex=True,
                                figsize=(12, 1.4 * (record.gpus + 1) + 1))
    for gpu in range(record.gpus):
        ax = axes[gpu]
        ax.plot(times, [r[0].get(gpu, float("nan")) for r in rows], lw=0.8, label="counted")
        ax.plot(times, [r[1].get(gpu, float("nan")) for r in rows], lw=0.8, ls="--",
                color="black", label="policy")
        ax.set_ylim(0, 1)
        ax.set_ylabel(f"GPU {gpu}", rotation=0, ha="right")
    axes[0].legend(loc="upper right", fontsize="small", ncol=2)
    figure.suptitle("share of each pair's second workload (kernels counted), and the "
                    "daemon's RSS; faults marked")
    rss = axes[-1]
    rss.plot(times, [s.rss_kib / 1024 if s.daemon_pid else float("nan")
                     for s in record.samples], color="tab:red")
    rss.set_ylabel("RSS MiB", rotation=0, ha="right")
    rss.set_xlabel("seconds")
    colours = dict(zip(FAULTS, ("tab:red", "tab:orange", "tab:purple", "tab:brown", "tab:pink",
                                "tab:olive"), strict=True))
    for fault in record.faults:
        for ax in axes:
            ax.axvline(fault.at, color=colours[fault.kind], lw=0.8, alpha=0.8)
        axes[0].annotate(fault.kind, (fault.at, 1.0), fontsize=6, rotation=90, va="bottom")
    figure.tight_layout(rect=(0, 0, 1, 0.97))
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return f"plot: {path}"


def write_outputs(record: Record, summary: Summary, out: Path) -> list[str]:
    """table.txt, soak.csv, probes.csv, windows.csv, daemon.log and soak.png under
    `out`; what was written, one line each."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.txt").write_text(table(summary) + "\n")
    (out / "daemon.log").write_text(record.daemon_log)
    write_csv(record, out / "soak.csv")
    write_probes(record, out / "probes.csv")
    write_windows(summary, out / "windows.csv")
    return [f"table: {out / 'table.txt'}",
            f"csv: {out / 'soak.csv'}, {out / 'probes.csv'}, {out / 'windows.csv'}",
            plot(record, out / "soak.png")]
