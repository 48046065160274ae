"""``vllm-srun threads verify | report | reset``: the host record from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from vllm_srun.runtime.artifact import DEFAULT_MODEL
from vllm_srun.runtime.errors import ConfigError
from vllm_srun.runtime.types import BackendName


def add_threads_commands(sub, add_threads_flags) -> None:
    threads = sub.add_parser("threads", help="what adaptive threads learned on this host")
    tsub = threads.add_subparsers(dest="threads_command", required=True)
    verify = tsub.add_parser(
        "verify", help="sweep inputs across every size range and allowed count and record "
                       "whether all answers were bit-identical (the voucher mode 2 needs)")
    reset = tsub.add_parser("reset", help="forget drift, learned counts and timings for this "
                                          "host, model revision and backend")
    for p in (verify, reset):
        p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="model (as for serve)")
        p.add_argument("--backend", choices=[b.value for b in BackendName],
                       default=BackendName.ONNXRUNTIME.value, help="CPU backend")
        p.add_argument("--mkl-cbwr", action="store_true",
                       help="torch: run with MKL_CBWR=AUTO, as `serve --mkl-cbwr` does")
        add_threads_flags(p)
    verify.add_argument("--threads", type=int, default=None,
                        help="the configured count answers are compared against")
    report = tsub.add_parser("report", help="per size range: served count, each count's "
                                            "median/p90 forward time, learned count, state")
    report.add_argument("--record", default=None, help="host record file")
    report.add_argument("--json", action="store_true", help="print JSON")
    report.add_argument("--plot", default=None, metavar="PNG", help="also write a plot")


def _ensure_cbwr(args: argparse.Namespace) -> None:
    if not getattr(args, "mkl_cbwr", False):
        return
    if args.backend != BackendName.TORCH.value:
        raise ConfigError("--mkl-cbwr applies to the torch backend only (--backend torch)")
    if os.environ.get("MKL_CBWR") != "AUTO":
        os.execve(sys.executable, [sys.executable, "-P", "-m", "vllm_srun.server",
                                   *sys.argv[1:]],
                  {**os.environ, "MKL_CBWR": "AUTO"})


def run_threads(args: argparse.Namespace) -> int:
    _ensure_cbwr(args)
    command = {"verify": _verify, "report": _report, "reset": _reset}[args.threads_command]
    return command(args)


def _open(args: argparse.Namespace):
    from vllm_srun.server.worker.assembly import open_record, record_path

    path = record_path(args.record)
    record, error = open_record(path)
    if record is None:
        raise ConfigError(f"host record {path}: {error}")
    if record.quarantined:
        print(f"vllm-srun: host record was unreadable and moved to {record.quarantined}",
              file=sys.stderr)
    return record


def _verify(args: argparse.Namespace) -> int:
    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.runtime.backend import load_backend
    from vllm_srun.runtime.budget import configured_threads, cpu_budget
    from vllm_srun.runtime.threads import ThreadContext
    from vllm_srun.server.worker.assembly import scope_for
    from vllm_srun.tuner.modes import allowed_counts, max_threads
    from vllm_srun.tuner.verify import sweep, sweep_batches

    budget = cpu_budget()
    configured = configured_threads(budget, args.threads)
    counts = allowed_counts(configured, budget, max_threads(budget, args.max_threads))
    manifest = resolve(args.model)
    backend = load_backend(manifest, args.backend)
    scope = scope_for(manifest, backend, budget)
    record = _open(args)
    context = ThreadContext()
    batches = sweep_batches(manifest.max_tokens)
    print(f"verify: {manifest.name} rev {manifest.revision} backend {args.backend}, "
          f"{len(batches)} batches, counts {list(counts)} against {configured}", file=sys.stderr)

    def progress(done: int, total: int, res) -> None:
        if done % 5 == 0 or done == total:
            print(f"verify: {done}/{total} batches, {res.comparisons} comparisons, "
                  f"{res.mismatches} mismatches", file=sys.stderr)

    try:
        result = sweep(lambda b, n: context.run(n, lambda: backend.forward(b, n)), configured,
                       counts, batches, progress)
    finally:
        context.shutdown()
    record.add_voucher(scope, "verify", result.comparisons, result.mismatches)
    print(f"{'range':>10}  {'comparisons':>11}  {'mismatches':>10}")
    for lo in sorted(result.by_range):
        c, bad = result.by_range[lo]
        print(f"{f'{lo}-{2 * lo - 1}':>10}  {c:>11}  {bad:>10}")
    if result.comparisons == 0:
        print("only one allowed count: nothing compared, no voucher (use --max-threads)")
        return 1
    if result.mismatches:
        print(f"NOT bit-identical across counts: {result.mismatches} of {result.comparisons} "
              f"comparisons differ; first: {json.dumps(result.first_mismatch)}")
        return 1
    print(f"bit-identical across counts {list(counts)} in all {result.comparisons} comparisons; "
          f"voucher recorded for host {scope.fingerprint} in {record.path}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from vllm_srun.tuner.adaptive import RangeLearning
    from vllm_srun.tuner.modes import AdaptiveMode
    from vllm_srun.tuner.report import ReportInput, build, plot, table

    record = _open(args)
    reports = []
    for scope in record.scopes():
        worker = record.worker(scope) or {"mode": 0, "configured": 1, "counts": [1]}
        ranges = {lo: RangeLearning(samples=by_count)
                  for lo, by_count in record.timings(scope).items()}
        for lo, row in record.learned(scope).items():
            r = ranges.setdefault(lo, RangeLearning())
            r.learned, r.streak = row["num_threads"], row["verified_passes"]
        inp = ReportInput(AdaptiveMode(worker["mode"]), worker["configured"],
                          tuple(worker["counts"]), scope, ranges, record.voucher(scope),
                          record.drift(scope), record_path=str(record.path))
        rep = build(inp)
        rep["model"] = worker.get("model")
        reports.append(rep)
    if args.json:
        print(json.dumps(reports, indent=1))
    else:
        if not reports:
            print(f"nothing learned yet in {record.path}")
        for rep in reports:
            print(f"model {rep['model']}\n" + table(rep))
    if args.plot and reports:
        plot(reports, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _reset(args: argparse.Namespace) -> int:
    from vllm_srun.records.host_record import Scope
    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.runtime.budget import cpu_budget
    from vllm_srun.runtime.host import host_fingerprint

    manifest = resolve(args.model)
    if args.backend == BackendName.TORCH.value:
        import torch  # noqa: F401  (its builds are part of the fingerprint)
    fingerprint, _ = host_fingerprint(args.backend, cpu_budget())
    scope = Scope(fingerprint, manifest.revision, args.backend)
    _open(args).reset(scope)
    print(f"reset learning for host {fingerprint}, {manifest.name} rev {manifest.revision}, "
          f"backend {args.backend}")
    return 0
