"""Fuzz the WAL reader: ``python -m tests.fuzz.run --cases N [--seconds S] [--engine random|hypothesis|atheris]``.

The cases are split over the targets of ``tests.support.wal_fuzz`` by weight and run in worker processes
(one per core), each job with its own seed, so a run is reproducible from ``--seed``. Engines:

- ``random`` (default): our own loop, a seeded ``random.Random`` driving the generators; the fast one.
- ``hypothesis``: ``@given(binary())`` programs for the generators, database off, not derandomised.
- ``atheris``: libFuzzer, coverage-guided over the same programs, one child process per target.

Every failure is minimised and saved under ``tests/data/fuzz/`` (``.bin`` input plus a ``.json`` sidecar
naming the target and the failure), at most one per target and kind that is not already there, so
``tests/test_fuzz_regressions.py`` replays it from then on. Prints one table; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

from tests.support.wal_fuzz import (
    SCRATCH_ENV,
    TARGETS,
    ByteChooser,
    FuzzFailure,
    RandomChooser,
    Target,
    frame_bytes,
    frames,
    run_program,
    seeds,
)

ROOT = Path(__file__).resolve().parents[2]
REGRESSION_DIR = ROOT / "tests" / "data" / "fuzz"
JOB_CASES = {"random": 4000, "hypothesis": 1000}
"""Cases per job: small enough for progress lines and a prompt ``--seconds`` stop."""
PROGRAM_MAX = 256
"""Longest program hypothesis and atheris generate (a program is the generator's choices)."""
ADDRESS_SPACE_LIMIT = 4 << 30
"""Workers' RLIMIT_AS: a reader that honoured a lying 4 GiB length would get MemoryError, not the machine's RAM."""
KEPT_PER_KIND = 3
"""Failing inputs a job keeps per (target, kind) for minimising; the rest are only counted."""
MINIMISE_SECONDS = 20.0


@dataclass
class Found:
    target: str
    kind: str
    detail: str
    data: bytes
    origin: str


@dataclass
class Job:
    engine: str
    target: str
    seed: str
    cases: int
    deadline: float


@dataclass
class Tally:
    cases: int = 0
    busy: float = 0.0
    failures: int = 0
    found: list[Found] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.cases += other.cases
        self.busy += other.busy
        self.failures += other.failures
        self.found += other.found


# --- engines: one job in a worker ---------------------------------------------------------------------
def _keep(tally: Tally, found: Found) -> None:
    tally.failures += 1
    if sum(1 for f in tally.found if f.kind == found.kind) < KEPT_PER_KIND:
        tally.found.append(found)


def _check(target: Target, data: bytes, tally: Tally, origin: str) -> None:
    try:
        target.check(data)
    except FuzzFailure as f:
        _keep(tally, Found(target.name, f.kind, f.detail, data, origin))
    except Exception as exc:  # a bug of the harness itself: still a failure, never a silent pass
        _keep(tally, Found(target.name, f"harness:{type(exc).__name__}", repr(exc), data, origin))


def random_job(job: Job) -> Tally:
    target = TARGETS[job.target]
    chooser = RandomChooser(random.Random(job.seed))
    tally = Tally()
    start = time.perf_counter()
    for i in range(job.cases):
        if i % 64 == 0 and time.time() > job.deadline:
            break
        _check(target, target.generate(chooser), tally, f"random seed {job.seed!r} case {i}")
        tally.cases += 1
    tally.busy = time.perf_counter() - start
    return tally


def hypothesis_job(job: Job) -> Tally:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    target = TARGETS[job.target]
    tally = Tally()
    last: list[Found] = []

    @hypothesis_seed(int.from_bytes(hashlib.sha256(job.seed.encode()).digest()[:8], "little"))
    @settings(
        max_examples=job.cases,
        database=None,
        derandomize=False,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate, Phase.shrink],
        report_multiple_bugs=False,
        print_blob=False,
    )
    @given(st.binary(max_size=PROGRAM_MAX))
    def fuzz(program: bytes) -> None:
        tally.cases += 1
        data = target.generate(ByteChooser(program))
        try:
            target.check(data)
        except FuzzFailure as f:
            # Hypothesis replays the minimal example last, so the last one recorded is the shrunk one.
            last[:] = [Found(target.name, f.kind, f.detail, data, f"hypothesis seed {job.seed!r}")]
            raise

    start = time.perf_counter()
    try:
        fuzz()
    except FuzzFailure:
        _keep(tally, last[0])
    except Exception as exc:
        _keep(tally, Found(target.name, f"harness:{type(exc).__name__}", repr(exc), b"", job.seed))
    tally.busy = time.perf_counter() - start
    return tally


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and terminates the pool
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = ADDRESS_SPACE_LIMIT if hard == resource.RLIM_INFINITY else min(hard, ADDRESS_SPACE_LIMIT)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    seeds()


def _run_job(job: Job) -> tuple[Job, Tally]:
    return job, (random_job if job.engine == "random" else hypothesis_job)(job)


def quotas(cases: int, targets: list[Target]) -> dict[str, int]:
    """``cases`` split by weight (the rounding goes to the first target)."""
    total = sum(t.weight for t in targets)
    out = {t.name: cases * t.weight // total for t in targets}
    out[targets[0].name] += cases - sum(out.values())
    return out


def make_jobs(engine: str, split: dict[str, int], seed: int, deadline: float) -> list[Job]:
    """Jobs of all targets interleaved, so a ``--seconds`` stop cuts every target in proportion."""
    size = JOB_CASES[engine]
    keyed = []
    for name, n in split.items():
        count = -(-n // size) if n else 0
        for i in range(count):
            cases = min(size, n - i * size)
            keyed.append(((i + 0.5) / count, Job(engine, name, f"{seed}:{name}:{i}", cases, deadline)))
    return [job for _, job in sorted(keyed, key=lambda kv: kv[0])]


def run_pool(jobs: list[Job], workers: int) -> dict[str, Tally]:
    tallies: dict[str, Tally] = {}
    t0 = time.monotonic()
    last_print = t0
    ctx = multiprocessing.get_context("fork")  # the workers inherit the built seeds and imports
    with ctx.Pool(workers, initializer=_worker_init) as pool:
        for job, tally in pool.imap_unordered(_run_job, jobs):
            tallies.setdefault(job.target, Tally()).add(tally)
            now = time.monotonic()
            if now - last_print >= 10:
                last_print = now
                done = sum(t.cases for t in tallies.values())
                failures = sum(t.failures for t in tallies.values())
                print(
                    f"[{now - t0:6.0f}s] {done:,} cases, {done / (now - t0):,.0f}/s, {failures} failures",
                    file=sys.stderr,
                )
    return tallies


# --- atheris: one libFuzzer child per target ------------------------------------------------------------
def atheris_unavailable() -> str | None:
    """Why atheris cannot run here, or None."""
    try:
        import atheris  # noqa: F401
    except ImportError as exc:
        return f"atheris is not installed ({exc}); `pip install atheris` (wheels exist for CPython 3.11 on x86-64)"
    except Exception as exc:
        return f"atheris does not load: {type(exc).__name__}: {exc}"
    return None


_ATHERIS_BOOT = """
import sys, atheris
with atheris.instrument_imports(include=["cdcd", "tests.fuzz"]):
    from tests.fuzz import run
run.atheris_child(*sys.argv[1:])
"""
"""The child imports the code under test inside ``instrument_imports``: coverage for cdcd and the harness only
(``instrument_all`` would spend ~20 s instrumenting the whole standard library first)."""


def atheris_child(target_name: str, cases: str, seconds: str, seed: str, artifacts: str, corpus: str) -> NoReturn:
    """Runs in the child process: libFuzzer over ``run_program`` of one target; never returns."""
    import atheris

    target = TARGETS[target_name]
    seeds()

    def one_input(program: bytes) -> None:
        run_program(target, program)

    argv = [
        "atheris",
        f"-runs={cases}",
        f"-seed={seed}",
        f"-artifact_prefix={artifacts}/",
        f"-max_len={PROGRAM_MAX}",
        "-len_control=0",  # programs of any length from the start: short ones are all-default choices
        "-timeout=30",
        "-rss_limit_mb=4096",
        "-print_final_stats=1",
    ]
    if float(seconds):
        argv.append(f"-max_total_time={max(1, int(float(seconds)))}")
    atheris.Setup([*argv, corpus], one_input)
    atheris.Fuzz()
    raise SystemExit(0)


def _write_corpus(directory: Path, seed: int, count: int = 64) -> None:
    """Random programs to start from (libFuzzer would otherwise begin with the empty input)."""
    rnd = random.Random(seed)
    directory.mkdir()
    for i in range(count):
        (directory / f"p{i}").write_bytes(rnd.randbytes(rnd.randrange(16, PROGRAM_MAX)))


def _atheris_tally(target: Target, stderr: str, artifacts: Path, busy: float, seed: int) -> Tally:
    m = re.search(r"stat::number_of_executed_units:\s*(\d+)", stderr) or re.search(r"Done (\d+) runs", stderr)
    tally = Tally(cases=int(m.group(1)) if m else 0, busy=busy)
    for artifact in sorted(artifacts.iterdir()):
        data = target.generate(ByteChooser(artifact.read_bytes()))
        before = tally.failures
        _check(target, data, tally, f"atheris seed {seed} ({artifact.name})")
        if tally.failures == before:  # libFuzzer saw a crash we cannot reproduce in-process (e.g. its timeout)
            _keep(tally, Found(target.name, f"atheris:{artifact.name.split('-')[0]}", stderr[-2000:], data, str(seed)))
    return tally


def run_atheris(split: dict[str, int], seconds: float | None, seed: int, workers: int) -> dict[str, Tally]:
    per_child = seconds * workers / max(1, len(split)) if seconds else 0.0
    pending = [(name, n) for name, n in split.items() if n]
    running: list[tuple[str, subprocess.Popen[str], Path, float, int, Path]] = []
    tallies: dict[str, Tally] = {}
    with tempfile.TemporaryDirectory(prefix="cdcd-atheris-") as tmp:
        while pending or running:
            while pending and len(running) < workers:
                name, n = pending.pop(0)
                child_seed = seed * 31 + len(tallies) + len(running) + 1
                artifacts = Path(tmp) / name
                artifacts.mkdir()
                corpus = Path(tmp) / f"{name}-corpus"
                _write_corpus(corpus, child_seed)
                log = Path(tmp) / f"{name}.log"
                args = [name, str(n), str(per_child), str(child_seed), str(artifacts), str(corpus)]
                cmd = [sys.executable, "-c", _ATHERIS_BOOT, *args]
                with log.open("w") as err:
                    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, cwd=ROOT)
                running.append((name, proc, artifacts, time.monotonic(), child_seed, log))
            time.sleep(0.2)
            for entry in [r for r in running if r[1].poll() is not None]:
                running.remove(entry)
                name, _proc, artifacts, started, child_seed, log = entry
                tally = _atheris_tally(
                    TARGETS[name], log.read_text(), artifacts, time.monotonic() - started, child_seed
                )
                tallies.setdefault(name, Tally()).add(tally)
                print(f"atheris {name}: {tally.cases:,} runs, {tally.failures} failures", file=sys.stderr)
    return tallies


# --- minimising and saving ------------------------------------------------------------------------------
def _fails_the_same(target: Target, kind: str) -> Callable[[bytes], bool]:
    def fails(data: bytes) -> bool:
        try:
            target.check(data)
        except FuzzFailure as f:
            return f.kind == kind
        except Exception:
            return False
        return False

    return fails


def _delete_chunks(data: bytes, fails: Callable[[bytes], bool], out_of_time: Callable[[], bool]) -> bytes:
    """Classic greedy delta debugging: drop ever smaller chunks while the failure stays."""
    chunk = max(1, len(data) // 2)
    while chunk >= 1 and not out_of_time():
        i, progressed = 0, False
        while i < len(data) and not out_of_time():
            candidate = data[:i] + data[i + chunk :]
            if fails(candidate):
                data, progressed = candidate, True
            else:
                i += chunk
        if not progressed:
            chunk //= 2
    return data


def _shrink_frames(data: bytes, fails: Callable[[bytes], bool], out_of_time: Callable[[], bool]) -> bytes:
    """Structure-aware passes for segments: drop whole frames, then shrink payloads keeping their CRC valid
    (byte deletion alone breaks the CRC, which hides the failure behind a CRC mismatch)."""
    for f in reversed(frames(data)):
        candidate = data[: f.offset] + data[f.end :]
        if not out_of_time() and fails(candidate):
            data = candidate
    for f in reversed(frames(data)):
        payload = data[f.start : f.end]

        def with_payload(p: bytes, f_offset: int = f.offset, f_end: int = f.end, rtype: int = f.rtype) -> bytes:
            return data[:f_offset] + frame_bytes(p, rtype) + data[f_end:]

        if fails(with_payload(payload)):
            smaller = _delete_chunks(payload, lambda p: fails(with_payload(p)), out_of_time)
            data = with_payload(smaller)
    return data


def minimise(target: Target, found: Found, seconds: float = MINIMISE_SECONDS) -> bytes:
    fails = _fails_the_same(target, found.kind)
    if not fails(found.data):
        return found.data  # flaky or environment-dependent: keep it as it was
    deadline = time.monotonic() + seconds

    def out_of_time() -> bool:
        return time.monotonic() > deadline

    data = found.data
    if target.name in ("segment", "memory"):
        data = _shrink_frames(data, fails, out_of_time)
    return _delete_chunks(data, fails, out_of_time)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def existing_kinds(directory: Path) -> set[tuple[str, str]]:
    kinds = set()
    for sidecar in directory.glob("*.json"):
        with contextlib.suppress(ValueError, KeyError, OSError):
            meta = json.loads(sidecar.read_text())
            kinds.add((meta["target"], meta.get("failure", "")))
    return kinds


def save_regression(directory: Path, found: Found, data: bytes, engine: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{found.target}-{_slug(found.kind)}-{hashlib.sha1(data).hexdigest()[:12]}"
    (directory / f"{stem}.bin").write_bytes(data)
    meta = {
        "target": found.target,
        "expect": "contract",
        "failure": found.kind,
        "detail": found.detail.splitlines()[0][:400] if found.detail else "",
        "found_by": f"{engine}: {found.origin}",
    }
    (directory / f"{stem}.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    return directory / f"{stem}.bin"


def save_failures(tallies: dict[str, Tally], directory: Path, engine: str) -> list[str]:
    """One minimised regression file per new (target, kind); returns report lines."""
    lines = []
    known = existing_kinds(directory)
    by_kind: dict[tuple[str, str], Found] = {}
    for tally in tallies.values():
        for found in tally.found:
            key = (found.target, found.kind)
            if key not in by_kind or len(found.data) < len(by_kind[key].data):
                by_kind[key] = found
    for key, found in sorted(by_kind.items()):
        first = found.detail.splitlines()[0][:300] if found.detail else ""
        if key in known:
            lines.append(f"  {found.target} {found.kind}: already in {directory.name}/ - {first}")
            continue
        data = minimise(TARGETS[found.target], found)
        path = save_regression(directory, found, data, engine)
        lines.append(f"  {found.target} {found.kind}: saved {os.path.relpath(path)} ({len(data)} bytes) - {first}")
    return lines


# --- report ---------------------------------------------------------------------------------------------
def table(engine: str, tallies: dict[str, Tally], wall: float, workers: int) -> str:
    rows = [("engine", "target", "cases", "cases/s", "failures")]
    for name, t in tallies.items():
        rows.append((engine, name, f"{t.cases:,}", f"{t.cases / t.busy:,.0f}" if t.busy else "-", str(t.failures)))
    total = sum(t.cases for t in tallies.values())
    failures = sum(t.failures for t in tallies.values())
    rows.append((engine, "TOTAL", f"{total:,}", f"{total / wall:,.0f}" if wall else "-", str(failures)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    out = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    out.append(f"wall {wall:.1f} s, {workers} worker(s); a target's cases/s is per worker, TOTAL's is overall")
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz.run", description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=1_000_000, help="total cases over all targets (default 1,000,000)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long even if cases remain")
    p.add_argument("--engine", choices=("random", "hypothesis", "atheris"), default="random")
    p.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated subset of {', '.join(TARGETS)}")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--seed", type=int, default=None, help="base seed (default: from the clock, printed)")
    p.add_argument("--save-dir", type=Path, default=REGRESSION_DIR, help="where failures are saved")
    return p.parse_args(argv)


def _selected(spec: str) -> list[Target]:
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown target(s) {', '.join(unknown)}; known: {', '.join(TARGETS)}")
    return [TARGETS[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else int(time.time())
    targets = _selected(args.targets)
    if args.engine == "atheris" and (why := atheris_unavailable()):
        print(f"engine atheris skipped: {why}")
        return 0
    split = quotas(args.cases, targets)
    deadline = time.time() + args.seconds if args.seconds else float("inf")
    print(f"fuzzing with engine {args.engine}, seed {seed}, {args.workers} worker(s): {split}", file=sys.stderr)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="cdcd-fuzz-run-", dir=shm) as scratch:
        os.environ[SCRATCH_ENV] = scratch  # inherited by the workers and atheris children; removed here
        t0 = time.monotonic()
        seeds()
        if args.engine == "atheris":
            tallies = run_atheris(split, args.seconds, seed, args.workers)
        else:
            tallies = run_pool(make_jobs(args.engine, split, seed, deadline), args.workers)
        wall = time.monotonic() - t0
        tallies = {t.name: tallies.get(t.name, Tally()) for t in targets}
        print(table(args.engine, tallies, wall, args.workers))
        if not any(t.failures for t in tallies.values()):
            return 0
        print("failures:")
        print("\n".join(save_failures(tallies, args.save_dir, args.engine)))
        return 1


if __name__ == "__main__":
    sys.exit(main())
