"""`kubetrain` command line: crd, validate, run, sweep; the cluster verbs are kubetrain.core.kube_cli's.

Exit codes: 0 success, 1 the job failed, 2 bad input (with one line per problem),
130 stopped by Ctrl-C (the run can be resumed by running it again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kubetrain.core import __version__, hardware, kube_cli
from kubetrain.core.api import KIND, Phase, SweepPhase, TrialState
from kubetrain.core.contract import EXPORT_MODULE, PROFILE_REQUEST_FILE, PROFILES_DIR, TENSORBOARD_DIR
from kubetrain.core.crd import CRDS, crd_yaml
from kubetrain.core.lifecycle import Reason
from kubetrain.core.local import LocalRun, LocalRunError, RunOptions
from kubetrain.core.progress import COMMIT_MARKER, complete_checkpoints
from kubetrain.core.sweep import report
from kubetrain.core.sweep.local import (
    STATUS_FILE,
    LocalSweep,
    SweepOptions,
    SweepResult,
    SweepRunError,
    template_manifest,
    to_yaml,
)
from kubetrain.core.sweep.trials import TRIALS_DIR
from kubetrain.core.validate import ManifestError, judge, load_documents, load_job, load_sweep


def _fail_at(value: str) -> tuple[int, int]:
    try:
        rank, step = (int(x) for x in value.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--fail-at must be RANK:STEP, e.g. 1:30 (got {value!r})") from None
    if rank < 0 or step < 1:
        raise argparse.ArgumentTypeError("--fail-at needs RANK >= 0 and STEP >= 1")
    return rank, step


def cmd_crd(args: argparse.Namespace) -> int:
    text = crd_yaml(args.kind)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    bad = 0
    for name in args.files:
        try:
            verdicts = judge(load_documents(Path(name)))
        except ManifestError as exc:
            print(exc, file=sys.stderr)
            bad += 1
            continue
        except OSError as exc:
            print(f"{name}: cannot read: {exc.strerror}", file=sys.stderr)
            bad += 1
            continue
        if not verdicts:
            print(f"{name}: (file): holds no TrainingJob", file=sys.stderr)
            bad += 1
        for verdict in verdicts:
            for p in verdict.problems:
                print(f"{verdict.source(name)}: {p}", file=sys.stderr)
            if verdict.problems:
                bad += 1
            else:
                print(f"{verdict.source(name)}: {verdict.summary()}")
    return 2 if bad else 0


Loaded = TypeVar("Loaded")


def _load(loader: Callable[[Path], Loaded], manifest: Path) -> Loaded | None:
    """The manifest's object, or None after saying on stderr why it cannot be used."""
    try:
        return loader(manifest)
    except ManifestError as exc:
        print(exc, file=sys.stderr)
    except OSError as exc:
        print(f"{manifest}: cannot read: {exc.strerror}", file=sys.stderr)
    return None


def cmd_run(args: argparse.Namespace) -> int:
    manifest = Path(args.file)
    job = _load(load_job, manifest)
    if job is None:
        return 2
    if args.workers is not None and args.workers < 1:
        print("--workers: must be >= 1", file=sys.stderr)
        return 2
    world = (args.workers or job.spec.workers) * job.spec.procs
    if args.fail_at and args.fail_at[0] >= world:
        print(f"--fail-at: rank {args.fail_at[0]} does not exist (world size {world})", file=sys.stderr)
        return 2
    opts = RunOptions(
        output_dir=Path(args.output_dir or Path("runs") / job.metadata.name),
        workers=args.workers,
        fail_at=args.fail_at,
        fresh=args.fresh,
        summary_json=Path(args.summary_json) if args.summary_json else None,
        quiet=args.quiet,
        workdir=Path(args.workdir).resolve() if args.workdir else None,
    )
    if opts.workdir is not None and not opts.workdir.is_dir():
        print(f"--workdir: {args.workdir} is not a directory", file=sys.stderr)
        return 2
    try:
        summary = LocalRun(job, Path(args.base_dir or args.workdir or manifest.parent).resolve(), opts).run()
    except LocalRunError as exc:
        print(f"kubetrain run: {exc}", file=sys.stderr)
        return 2
    loss = (
        f"loss {summary.initial_loss:.4f} -> {summary.final_loss:.4f}"
        if summary.initial_loss is not None and summary.final_loss is not None
        else "no loss reported"
    ) + (f" (eval {summary.eval_loss:.4f}{best_eval_text(summary.best_eval_step)})" if summary.eval_loss else "")
    print(
        f"{summary.name}: {summary.phase} ({summary.reason}) after {summary.steps}/{summary.max_steps} steps, "
        f"{loss}, {summary.restarts} restart(s), {summary.tokens_per_second:,.0f} tokens/s, "
        f"{summary.wall_seconds:.1f}s; checkpoints at {summary.checkpoints}"
        + (f"; transport {summary.network_transport}" if summary.network_transport else "")
        + (f"; resumed from {resumed_text(summary.resumed_from, summary.resumed_tiers)}" if summary.resumed_from else "")
    )
    if summary.preflight:
        print(f"  {preflight_line(summary.preflight)}")
    if summary.memory:
        print(f"  {memory_line(summary.memory)}")
    if summary.phase == Phase.FAILED:
        print(f"  {summary.message}", file=sys.stderr)
    native = None if summary.bf16_emulated is None else not summary.bf16_emulated
    if notice := hardware.bf16_notice(summary.bf16_slowdown, native):
        print(f"  {notice}")  # said before the start too; repeated where the run's cost is read
    print(f"summary: {opts.summary_json or Path(summary.output_dir) / 'summary.json'}")
    if summary.phase == Phase.SUSPENDED:  # suspend: true ends at once (0); Ctrl-C ends as a shell says (130)
        return 130 if summary.reason == Reason.INTERRUPTED else 0
    return 0 if summary.phase == Phase.SUCCEEDED else 1


def cmd_sweep(args: argparse.Namespace) -> int:
    manifest = Path(args.file)
    sweep = _load(load_sweep, manifest)
    if sweep is None:
        return 2
    if args.export_template:
        sys.stdout.write(to_yaml(template_manifest(sweep, manifest.parent)))
        return 0
    opts = SweepOptions(
        output_dir=Path(args.output_dir or Path("runs") / sweep.metadata.name),
        storage=args.storage,
        fresh=args.fresh,
        quiet=args.quiet,
        summary_json=Path(args.summary_json) if args.summary_json else None,
    )
    try:
        result = LocalSweep(sweep, manifest.parent, opts).run()
    except SweepRunError as exc:
        print(f"kubetrain sweep: {exc}", file=sys.stderr)
        return 2
    _print_sweep(result)
    if result.interrupted:
        return 130
    return 0 if result.status.phase == SweepPhase.SUCCEEDED else 1


def run_dir(run: str) -> Path:
    """A local run's output directory: RUN itself when it is a directory, else runs/RUN."""
    return Path(run) if Path(run).is_dir() else Path("runs") / run


def export_source(run: str, step: int | None) -> tuple[Path, Path | None]:
    """(checkpoint directory, the committed step to export) of RUN: a local run's output directory (or runs/RUN),
    a checkpoint directory, or one committed step-N directory; None: no such step committed there."""
    base = run_dir(run)
    if (base / COMMIT_MARKER).is_file():
        return base.parent, base
    root = base / "checkpoints" if (base / "checkpoints").is_dir() else base
    done = dict(complete_checkpoints(root))
    pick = step if step is not None else max(done, default=None)
    return root, done.get(pick) if pick is not None else None


def cmd_export(args: argparse.Namespace) -> int:
    root, step_dir = export_source(args.run, args.step)
    if step_dir is None:
        which = f"step {args.step}" if args.step is not None else "any step"
        print(f"kubetrain export: no committed checkpoint of {which} in {root}", file=sys.stderr)
        return 2
    config = Path(args.file) if args.file else next(
        (c for c in (root.parent / "config.json", root / "config.json") if c.is_file()), None)
    if config is None:
        print(f"kubetrain export: the job's manifest is needed (-f FILE): no config.json beside {root}", file=sys.stderr)
        return 2
    if config.suffix in (".yaml", ".yml"):
        job = _load(load_job, config)
        if job is None:
            return 2
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            f.write(json.dumps(job.spec.dump()))
        spec_file = Path(f.name)
    else:
        spec_file = config
    # An earlier step gets a directory of its own: the export at success (status.export) stays as it is.
    out = Path(args.output) if args.output else root / ("export" if args.step is None else f"export-step-{args.step}")
    cache = root.parent / "cache"  # a local run's fetched model.hfUri and data.tokenizerUri
    try:
        return subprocess.call([sys.executable, "-m", EXPORT_MODULE, "--config", str(spec_file),
                                "--step-dir", str(step_dir), "--out", str(out),
                                *(["--cache", str(cache)] if cache.is_dir() else [])])
    finally:
        if spec_file != config:
            spec_file.unlink(missing_ok=True)


def cmd_profile(args: argparse.Namespace) -> int:
    out = run_dir(args.run)
    if not (out / "progress.json").exists():
        print(f"kubetrain: {out} is not a local run's output directory (no progress.json)", file=sys.stderr)
        return 2
    if not 1 <= args.steps <= 1000:
        print("kubetrain: --steps must be 1 to 1000", file=sys.stderr)
        return 2
    (out / PROFILE_REQUEST_FILE).write_text(f"{args.steps}:{time.time():.0f}\n")
    print(f"asked rank 0 to profile its next {args.steps} step(s); the trace goes to "
          f"{out / 'checkpoints' / PROFILES_DIR}/rank0-steps<A>-<B>.pt.trace.json")
    return 0


def board_dir(run: str) -> Path | None:
    """Where a local run's event files are: RUN as a directory (the output directory or its checkpoints),
    else runs/RUN; None when none of them holds any."""
    base = run_dir(run)
    for candidate in (base / "checkpoints" / TENSORBOARD_DIR, base / TENSORBOARD_DIR):
        if candidate.is_dir() and any(candidate.glob("events.out.tfevents.*")):
            return candidate
    return None


def cmd_tensorboard(args: argparse.Namespace) -> int:
    found = board_dir(args.run)
    if found is None:
        print(f"kubetrain: no TensorBoard event files for {args.run!r} (looked in {args.run} and runs/{args.run}, "
              f"under checkpoints/{TENSORBOARD_DIR}/)", file=sys.stderr)
        return 2
    command = ["tensorboard", "--logdir", str(found), "--host", "127.0.0.1", "--port", str(args.port)]
    if shutil.which("tensorboard") is None:
        print(f"event files: {found}\nTensorBoard is not installed here: pip install tensorboard, then "
              f"{' '.join(command)}")
        return 0
    print(f"event files: {found}; TensorBoard at http://127.0.0.1:{args.port}/", flush=True)
    os.execvp(command[0], command)  # TensorBoard takes this process over (Ctrl-C stops it)
    return 0  # not reached


def _print_sweep(result: SweepResult) -> None:
    """The outcome on stdout: counts, the best trial, the time comparison and the best manifest."""
    st = result.status
    print(f"sweep {result.name}: {'stopped, run again to resume' if result.interrupted else st.phase} "
          f"({st.reason}): {len(st.trials)} trials: {st.trials_complete} complete, {st.trials_pruned} pruned, "
          f"{st.trials_failed} failed, {st.trials_running} unfinished")
    logs = [str(result.output_dir / TRIALS_DIR / t.job_name / "run.log") for t in st.trials if t.state == TrialState.FAILED]
    if logs:
        print(f"logs of the failed trials: {', '.join(logs)}")
    if st.best_trial is not None and st.best_value is not None:
        print(f"best: trial {st.best_trial}, {st.best_value:.6g} {result.objective} loss "
              f"({report.format_params(st.best_params or {})})")
    for line in result.timing.lines():
        print(line)
    print(f"status: {result.output_dir / STATUS_FILE}")
    if result.best_file is not None and result.best_manifest is not None:
        print(f"best manifest: {result.best_file} (kubetrain run {result.best_file}):")
        sys.stdout.write(to_yaml(result.best_manifest))


def _add_sweep(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    w = sub.add_parser("sweep", help="run a TrainingSweep (hyperparameter search) on this machine as local runs")
    w.add_argument("file", metavar="FILE", help="TrainingSweep manifest (YAML)")
    w.add_argument("--output-dir", help="sweep-status.json, trials/<job>/, best.yaml (default: runs/<sweep name>)")
    w.add_argument("--storage", metavar="URL",
                   help="also copy every finished trial into the Optuna study named after the sweep at this "
                   "storage URL (e.g. sqlite:///runs/lr-sweep/optuna.db, for optuna-dashboard)")
    w.add_argument("--fresh", action="store_true", help="discard a sweep saved in the output dir, do not resume it")
    w.add_argument("-q", "--quiet", action="store_true", help="no live table; events and the result only")
    w.add_argument("--summary-json", help="also write the final status, the best trial and the timings (JSON) here")
    w.add_argument("--export-template", action="store_true",
                   help="print the template as a TrainingJob of its own (<sweep>-template) and exit")
    w.set_defaults(func=cmd_sweep)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kubetrain",
        description="Distributed PyTorch training jobs: run a TrainingJob or a TrainingSweep locally, validate them, "
        "print the CRDs, and submit / list / status / describe / logs / wait / suspend / resume / delete against the "
        "cluster of the current kubeconfig (or, with --local, the runs of this machine).",
    )
    p.add_argument("--version", action="version", version=f"kubetrain {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("crd", help="print a CustomResourceDefinition (generated from the API models)")
    c.add_argument("--kind", choices=sorted(CRDS), default=KIND, help="TrainingJob (default), TrainingSweep, TrainingRuntime or ClusterTrainingRuntime")
    c.add_argument("-o", "--output", help="write to this file instead of stdout")
    c.set_defaults(func=cmd_crd)

    v = sub.add_parser("validate", help="check TrainingJob and TrainingSweep manifests; exit 2, one line per problem")
    v.add_argument("files", nargs="+", metavar="FILE")
    v.set_defaults(func=cmd_validate)

    r = sub.add_parser("run", help="run a TrainingJob on this machine as local worker processes")
    r.add_argument("file", metavar="FILE", help="TrainingJob manifest (YAML)")
    r.add_argument("--workers", type=int, help="override spec.workers")
    r.add_argument("--output-dir", help="checkpoints, logs and progress (default: runs/<job name>)")
    r.add_argument("--summary-json", help="also write the run summary (JSON) here")
    r.add_argument("--fail-at", type=_fail_at, metavar="RANK:STEP", help="kill RANK when it reaches STEP (once)")
    r.add_argument("--fresh", action="store_true", help="discard an unfinished run in the output dir")
    r.add_argument("-q", "--quiet", action="store_true", help="no live progress line")
    r.add_argument("--base-dir", metavar="DIR",
                   help="resolve the manifest's relative paths (spec.data.path) against DIR, not its own directory")
    r.add_argument("--workdir", metavar="DIR", help="run every process in DIR, as pods run in the directory "
                   "`kubetrain submit --workdir DIR` ships (relative command and data.path resolve there)")
    r.set_defaults(func=cmd_run)

    _add_sweep(sub)

    f = sub.add_parser("profile", help="ask a running local run's rank 0 for a torch.profiler trace of its next steps")
    f.add_argument("run", metavar="RUN", help="a local run: its job name (runs/RUN) or its output directory")
    f.add_argument("--steps", type=int, default=3, help="how many steps to profile (default 3)")
    f.set_defaults(func=cmd_profile)

    e = sub.add_parser("export", help="write a committed checkpoint as a Hugging Face model directory")
    e.add_argument("run", metavar="RUN|DIR", help="a local run (its job name, runs/RUN, or its output directory), a "
                   "checkpoint directory, or one committed step-N directory")
    e.add_argument("-f", "--file", help="the job's manifest (default: the local run's config.json)")
    e.add_argument("--step", type=int, help="the committed step to export (default: the newest)")
    e.add_argument("-o", "--output", help="where to write it, replacing an earlier export there (default: "
                   "<checkpoint directory>/export, or export-step-N with --step)")
    e.set_defaults(func=cmd_export)

    t = sub.add_parser("tensorboard", help="open TensorBoard on a local run's scalars (rank 0's event files)")
    t.add_argument("run", metavar="RUN", help="a local run: its job name (runs/RUN) or its output directory")
    t.add_argument("--port", type=int, default=6006)
    t.set_defaults(func=cmd_tensorboard)

    kube_cli.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())


def preflight_line(p: dict[str, Any]) -> str:
    """The summary's preflight line (status.preflight in wire form)."""
    busbw = f", all-reduce {p['busBandwidthGbps']:.3f} GB/s" if p.get("busBandwidthGbps") is not None else ""
    degraded = f", degraded ranks {p['degradedRanks']}" if p.get("degradedRanks") else ""
    return (f"preflight: {p.get('worldSize')} rank(s), compute median {p.get('medianGflops', 0):.1f} GFLOP/s, "
            f"slowest rank {p.get('slowestRank')}{busbw}{degraded}; {p.get('seconds', 0):.2f}s")


def memory_line(m: dict[str, Any]) -> str:
    """The summary's memory line (status.memory in wire form): the highest peaks, by rank, and the notices."""
    ranks = m.get("ranks") or []
    host = max(ranks, key=lambda r: r.get("hostPeakBytes", 0), default=None)
    line = f"memory: peak host {m.get('hostPeakBytes', 0) / 2**30:.2f} GiB" + (f" (rank {host['rank']})" if host else "")
    if m.get("devicePeakBytes") is not None:
        device = max(ranks, key=lambda r: r.get("devicePeakBytes") or 0, default=None)
        line += f", GPU {m['devicePeakBytes'] / 2**30:.2f} GiB" + (f" (rank {device['rank']})" if device else "")
    return "; ".join([f"{line} at step {m.get('step', 0)}", *(m.get("notices") or [])])


def best_eval_text(step: int | None) -> str:
    """Only the built-in trainer keeps a best-eval checkpoint; a custom command's eval loss comes alone."""
    return f", best at step {step}" if step is not None else ""


def resumed_text(steps: list[int], tiers: list[str | None]) -> str:
    """The summary's resumes: `step 30 (memory), step 40 (durable)`."""
    padded = [*tiers, *[None] * (len(steps) - len(tiers))][: len(steps)]
    return ", ".join(f"step {s}" + (f" ({t})" if t else "") for s, t in zip(steps, padded, strict=True))
