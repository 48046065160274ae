"""``vllm-srun threads verify | report | reset``: the host record from the command line."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import asdict

from vllm_srun.runtime.artifact import DEFAULT_MODEL
from vllm_srun.runtime.calibrate import CPU_CAP
from vllm_srun.runtime.errors import ConfigError
from vllm_srun.runtime.precision import Precision
from vllm_srun.runtime.types import BackendName
from vllm_srun.server.frontend.progress import Progress


def add_threads_commands(sub, add_threads_flags) -> None:
    threads = sub.add_parser("threads", help="what adaptive threads learned on this host")
    tsub = threads.add_subparsers(dest="threads_command", required=True)
    verify = tsub.add_parser(
        "verify", help="sweep every forward shape the engine can run (rows x padded length) at "
                       "every allowed count and record whether all answers were bit-identical "
                       "and what was covered (the voucher mode 2 needs; mode 2 also verifies "
                       "the shapes its traffic brings, one by one). Shapes verified already "
                       "are skipped; size ranges traffic reached go first")
    reset = tsub.add_parser("reset", help="forget drift, learned counts and timings for this "
                                          "host, model revision and backend")
    for p in (verify, reset):
        p.add_argument("model", nargs="?", default=DEFAULT_MODEL, help="model (as for serve)")
        p.add_argument("--revision", default=None, metavar="REV",
                       help="branch, tag or commit of a Hugging Face Hub id model (as for "
                            "serve; default: main)")
        p.add_argument("--backend", choices=[b.value for b in BackendName],
                       default=BackendName.ONNXRUNTIME.value, help="CPU backend")
        p.add_argument("--mkl-cbwr", action="store_true",
                       help="torch: run with MKL_CBWR=AUTO, as `serve --mkl-cbwr` does")
        p.add_argument("--dtype", choices=[x.value for x in Precision],
                       default=Precision.FLOAT32.value,
                       help="the precision whose learning this is (learning is kept per "
                            "precision; for a deployment served with auto, the one it chose: "
                            "see /v1/models)")
        add_threads_flags(p)
    verify.add_argument("--threads", type=int, default=None,
                        help="the configured count answers are compared against")
    verify.add_argument("--max-num-seqs", type=_positive("--max-num-seqs"), default=32,
                        help="rows per forward to cover (the workers' max_num_seqs; default 32)")
    verify.add_argument("--max-num-batched-tokens", type=_positive("--max-num-batched-tokens"),
                        default=CPU_CAP, help="padded tokens per forward to cover (the workers' "
                        f"max_num_batched_tokens; default {CPU_CAP}, the most a CPU worker "
                        "calibrates)")
    verify.add_argument("--min-tokens", type=_positive("--min-tokens"), default=2,
                        help="shortest padded length to cover (default 2: any input); shorter "
                             "forwards stay at the configured count in mode 2")
    verify.add_argument("--max-tokens", type=_positive("--max-tokens"), default=None,
                        help="longest padded length to cover (default: the model's limit); "
                             "longer forwards stay at the configured count in mode 2")
    verify.add_argument("--grid", action="store_true",
                        help="only the padded lengths of the grid mode 2 pads the shapes no "
                             "sweep covers to (every length up to 16 tokens, then steps of at "
                             "most 1/8 of the length): about a third of the shapes, and mode 2 "
                             "then pads its forwards to the grid (about 5%% more forward time "
                             "at one row; default: every length, no padding)")
    verify.add_argument("--budget-s", type=_positive("--budget-s"), default=None,
                        help="stop after this many seconds; the shapes compared by then are "
                             "recorded one by one (mode 2 serves learned counts for exactly "
                             "those), and a later run goes on from there (default: no limit)")
    verify.add_argument("--max-shapes", type=_positive("--max-shapes"), default=None,
                        help="compare at most this many shapes, recorded as --budget-s says "
                             "(default: every shape of the sweep)")
    report = tsub.add_parser("report", help="per size range: served count, each count's "
                                            "median/p90 forward time, learned count, state")
    report.add_argument("--record", default=None, help="host record file")
    report.add_argument("--json", action="store_true", help="print JSON")
    report.add_argument("--dtype", choices=[x.value for x in Precision], default=None,
                        help="only this precision's learning (default: every precision)")
    report.add_argument("--plot", default=None, metavar="PNG", help="also write a plot")


def _positive(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, not {text!r}")
        return value
    return parse


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
    from vllm_srun.server.worker.assembly import scope_for
    from vllm_srun.tuner.modes import allowed_counts, max_threads
    from vllm_srun.tuner.report_view import coverage_text
    from vllm_srun.tuner.verify import ShapeBounds, order_shapes, plan_sweep, unverified

    budget = cpu_budget()
    configured = configured_threads(budget, args.threads)
    counts = allowed_counts(configured, budget, max_threads(budget, args.max_threads))
    manifest = resolve(args.model, args.revision)
    longest = args.max_tokens or manifest.max_tokens
    if longest > manifest.max_tokens:
        raise ConfigError(f"--max-tokens {longest} is above {manifest.name}'s limit of "
                          f"{manifest.max_tokens} tokens")
    try:
        bounds = ShapeBounds(args.max_num_seqs, longest, args.max_num_batched_tokens,
                             args.min_tokens, grid=args.grid)
    except ValueError as exc:
        raise ConfigError(f"threads verify: {exc}".replace("min_len", "--min-tokens")
                          .replace("max_len", "--max-tokens")) from exc
    plan = plan_sweep(bounds)
    coverage = plan.coverage(counts)
    if len(counts) < 2:
        print(f"only one allowed count {list(counts)}: nothing to compare, no voucher "
              "(allow more with --max-threads)")
        return 1
    backend = load_backend(manifest, args.backend, precision=args.dtype)
    scope = scope_for(manifest, backend, budget, args.dtype)
    record = _open(args)
    voucher = record.voucher(scope)
    if voucher.shape_mismatches or voucher.mismatches:
        print("answers already differed across counts for this scope: nothing can vouch "
              "until `vllm-srun threads reset`")
        return 1
    todo = unverified(plan.shapes, voucher.verified, configured, counts)
    todo = order_shapes(todo, {lo: sum(map(len, by.values()))
                               for lo, by in record.timings(scope).items()})
    print(f"verify: {manifest.name} rev {manifest.revision} backend {args.backend} precision "
          f"{args.dtype}, counts {list(counts)} against {configured}; {len(plan.shapes)} "
          f"shapes: {coverage_text(asdict(coverage))}; {len(plan.shapes) - len(todo)} verified "
          f"already, {len(todo)} to compare ({sum(r * n for r, n in todo)} padded tokens per "
          f"count){_bounds_text(args)}", file=sys.stderr)
    result, writer = _run_sweep(args, backend, record, scope, configured, counts, todo,
                                budget)
    complete = not result.stopped
    if complete and result.comparisons:
        record.add_voucher(scope, "verify", result.comparisons, result.mismatches, coverage)
    elif result.comparisons:  # counted, covering only the shapes it recorded one by one
        record.add_voucher(scope, "verify-shapes", result.comparisons, result.mismatches)
    print(f"{'range':>12}  {'comparisons':>11}  {'mismatches':>10}")
    for lo in sorted(result.by_range):
        c, bad = result.by_range[lo]
        print(f"{f'{lo}-{2 * lo - 1}':>12}  {c:>11}  {bad:>10}")
    if result.mismatches:
        print(f"NOT bit-identical across counts: {result.mismatches} of {result.comparisons} "
              f"comparisons differ; first: {json.dumps(result.first_mismatch)}; mode 2 will "
              "not serve learned counts for this scope until `vllm-srun threads reset`")
        return 1
    if complete and not result.comparisons:
        print(f"every shape of the sweep was verified already, one by one ({len(plan.shapes)});"
              " nothing compared, no new voucher")
        return 0
    if complete:
        print(f"covered: counts {list(coverage.counts)}; {coverage_text(asdict(coverage))}")
        print(f"bit-identical across counts {list(counts)} in all {result.comparisons} "
              f"comparisons; voucher recorded for host {scope.fingerprint} in {record.path}")
        return 0
    left = len(todo) - result.shapes
    print(f"stopped at {'--budget-s' if writer.budget_hit else '--max-shapes'}: "
          f"{result.shapes} of {len(todo)} shapes compared, bit-identical, each recorded one "
          f"by one (mode 2 serves learned counts for exactly these shapes; {left} left: run "
          "again to go on)")
    return 0


def _bounds_text(args: argparse.Namespace) -> str:
    limits = [f"at most {args.budget_s} s" if args.budget_s else "",
              f"at most {args.max_shapes} shapes" if args.max_shapes else ""]
    return f"; {' and '.join(x for x in limits if x)}" if any(limits) else ""


class _ShapeWriter:
    """Records the sweep's comparisons one shape at a time, in one transaction every
    ``every_s`` (an interrupted sweep keeps what it compared), and says when to stop."""

    def __init__(self, record, scope, configured: int, args: argparse.Namespace,
                 every_s: float = 2.0) -> None:
        self.record, self.scope, self.configured = record, scope, configured
        self.max_shapes, self.every_s = args.max_shapes, every_s
        self.deadline = time.monotonic() + args.budget_s if args.budget_s else None
        self.equal: list[tuple[int, int, int]] = []
        self.differed: list[tuple[int, int, int]] = []
        self.last, self.budget_hit = time.monotonic(), False

    def add(self, shape: tuple[int, int], count: int, equal: bool) -> None:
        (self.equal if equal else self.differed).append((*shape, count))
        if time.monotonic() - self.last >= self.every_s:
            self.write()

    def write(self) -> None:
        self.record.add_verified_shapes(self.scope, self.configured, self.equal, self.differed,
                                        source="verify")
        self.equal, self.differed, self.last = [], [], time.monotonic()

    def stop(self, result) -> bool:
        self.budget_hit = self.deadline is not None and time.monotonic() >= self.deadline
        return self.budget_hit or (self.max_shapes is not None
                                   and result.shapes >= self.max_shapes)


# A sweep runs forwards on up to this many lanes at once (``verify.sweep``): each lane is a
# backend twin with sessions of its own at every count it ran, holding the activations of the
# largest shape it ran (hundreds of MB at 16,384 padded tokens even for a small model), so
# lanes cost memory in proportion; 8 keep a host's cores busy at counts of budget / 8 and up
MAX_LANES = 8


def _run_sweep(args, backend, record, scope, configured, counts, todo, budget: int):
    """The sweep of ``todo`` with a progress bar and ETA, its shapes recorded as it goes, its
    forwards on as many lanes as the smallest count fits in the CPU budget (at most
    ``MAX_LANES``)."""
    from functools import partial

    from vllm_srun.runtime.threads import ThreadContext
    from vllm_srun.tuner.verify import sweep

    def on(context, way, batch, n):
        return context.run(n, lambda: way.forward(batch, n))

    contexts = [ThreadContext() for _ in range(min(MAX_LANES, max(1, budget // min(counts))))]
    twins = [backend.twin() for _ in contexts[1:]]
    lanes = [partial(on, c, w) for c, w in zip(contexts[1:], twins, strict=True)]
    done_tokens = list(itertools.accumulate(r * n for r, n in todo))
    bar = Progress("verify", done_tokens[-1] if done_tokens else 0)
    writer = _ShapeWriter(record, scope, configured, args)

    def counts_text(res) -> str:
        return (f"{res.shapes}/{len(todo)} shapes, {res.comparisons} comparisons, "
                f"{res.mismatches} mismatches")

    try:
        result = sweep(partial(on, contexts[0], backend), configured, counts, todo,
                       progress=lambda res, _total: bar.update(done_tokens[res.shapes - 1],
                                                               counts_text(res)),
                       until=writer.stop, on_shape=writer.add, lanes=lanes, cores=budget)
    finally:
        for context in contexts:
            context.shutdown()
        for twin in twins:
            if twin is not backend:
                twin.close()
        writer.write()
    bar.finish(counts_text(result))
    return result, writer


def _report(args: argparse.Namespace) -> int:
    from vllm_srun.tuner.report import document
    from vllm_srun.tuner.report_view import plot, tables

    record = _open(args)
    doc = document([_scope_report(record, scope) for scope in record.scopes()
                     if args.dtype is None or scope.precision == args.dtype], "record")
    if args.json:
        print(json.dumps(doc, indent=1))
    elif not doc["reports"]:
        print(f"nothing learned yet in {record.path}")
    else:
        print(tables(doc), end="")
    if args.plot and doc["reports"]:
        plot(doc["reports"], args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def _scope_report(record, scope) -> dict:
    """What the record holds for one scope, as the report a worker would give: its stored
    samples, learned counts, voucher and drift; a learned count counts as served where the
    last worker ran mode 2 and it passed its window under a voucher, as that worker did."""
    from vllm_srun.tuner.adaptive import TunerSettings
    from vllm_srun.tuner.modes import AdaptiveMode
    from vllm_srun.tuner.ranges import Phase, RangeLearning
    from vllm_srun.tuner.report import DecisionRule, RecordState, ReportInput, build

    settings = TunerSettings()
    worker = record.worker(scope) or {"mode": 0, "configured": 1, "counts": [1]}
    mode, configured = AdaptiveMode(worker["mode"]), worker["configured"]
    voucher = record.voucher(scope)
    ranges = {lo: RangeLearning(samples=by_count)
              for lo, by_count in record.timings(scope).items()}
    passes = {}
    for lo, row in record.learned(scope).items():
        r = ranges.setdefault(lo, RangeLearning())
        r.learned, passes[lo] = row["num_threads"], row["verified_passes"]
        r.candidate = r.learned if row["origin"] == "sibling" else None  # ``learned_from``
        r.phase = Phase.LEARNED if mode is not AdaptiveMode.SERVE or r.learned == configured \
            else Phase.SERVING if (passes[lo] >= settings.learning.window
                                   and voucher.covers_counts(r.learned, configured)) \
            else Phase.VERIFYING
    state = RecordState(scope, voucher, record.drift(scope), path=str(record.path))
    inp = ReportInput(mode, configured, tuple(worker["counts"]), ranges, state,
                      DecisionRule(settings.learning.margin, settings.learning.min_samples),
                      model=worker.get("model"), verified_passes=passes)
    rep = build(inp)
    rep["notes"].append("from the record: every stored sample of every worker of this scope "
                        "(a worker decides on its own last "
                        f"{settings.learning.max_samples} per count)")
    return rep


def _reset(args: argparse.Namespace) -> int:
    from vllm_srun.records.host_record import Scope
    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.runtime.budget import cpu_budget
    from vllm_srun.runtime.host import host_fingerprint
    from vllm_srun.runtime.precision import check_supported

    manifest = resolve(args.model, args.revision)
    if args.backend == BackendName.TORCH.value:
        import torch  # noqa: F401  (its builds are part of the fingerprint)
    fingerprint, _ = host_fingerprint(args.backend, cpu_budget())
    check_supported(args.backend, args.dtype)
    scope = Scope(fingerprint, manifest.revision, args.backend, args.dtype)
    _open(args).reset(scope)
    print(f"reset learning for host {fingerprint}, {manifest.name} rev {manifest.revision}, "
          f"backend {args.backend}, precision {args.dtype}: drift, learned counts and timings "
          "forgotten, vouchers retired (run `vllm-srun threads verify` again before mode 2 "
          "serves learned counts)")
    return 0
