"""The ``vllm-srun`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from vllm_srun.runtime.artifact import BUILTIN_MODELS, DEFAULT_MODEL
from vllm_srun.runtime.errors import ConfigError, RuntimeFault
from vllm_srun.runtime.types import BackendName
from vllm_srun.server.frontend.auth import api_key
from vllm_srun.server.frontend.settings import (
    API_KEY,
    DEPLOYMENT_SETTINGS,
    LEARNING_SHARE,
    LOG_FORMAT,
    MAX_THREADS,
    PRECEDENCE,
    RECORD,
    add_flags,
    deployment_edits,
)
from vllm_srun.server.worker.logs import LOG_FORMAT_ENV, log_format
from vllm_srun.server.worker.logs import configure as configure_logging

log = logging.getLogger("vllm_srun")


def _positive(flag: str):
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} must be a positive integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag} must be a positive integer, got {text!r}")
        return value
    return parse


def _port(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--port must be an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"--port must be in 0..65535, got {text!r}")
    return value


def _version() -> str:
    """The installed distribution's version (its metadata, not a copy in the source)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm-srun")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-srun", description="Serve encoder models (embeddings, classifiers) on the CPU.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="serve a model over HTTP",
        description="Serve one model over HTTP (OpenAI-compatible /v1/embeddings).",
        epilog=PRECEDENCE)
    _add_config_flags(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: %(default)s)")
    serve.add_argument("--port", type=_port, default=8000,
                       help="port to bind (0 = any free; default: %(default)s)")
    serve.add_argument("--max-body-bytes", type=_positive("--max-body-bytes"),
                       default=4 * 1024 * 1024,
                       help="largest request body accepted (default: %(default)s)")
    add_flags(serve, (API_KEY,))
    _add_threads_flags(serve)
    add_flags(serve, (LEARNING_SHARE,))
    serve.add_argument("--mkl-cbwr", action="store_true",
                       help="torch backend: run with MKL_CBWR=AUTO (MKL's reproducible mode, "
                            "set before torch loads), which makes answers bit-identical across "
                            "thread counts on hosts where they otherwise drift")
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"],
                       help="log level (default: %(default)s)")
    add_flags(serve, (LOG_FORMAT,))
    from vllm_srun.server.frontend.threads_cli import add_threads_commands

    add_threads_commands(sub, _add_threads_flags)
    config = sub.add_parser("config", help="the canonical config the flags and file make")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser(
        "show", help="print the canonical config.yaml that serve would run with the same "
                     "flags (flags and file are one resource)")
    _add_config_flags(show)
    return parser


def _device_ids(text: str) -> list[int]:
    try:
        ids = [int(x, 10) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--device-ids must be comma-separated integers like 0,1, got {text!r}") from None
    if any(i < 0 or i > 255 for i in ids):
        raise argparse.ArgumentTypeError(f"--device-ids must be in 0..255, got {text!r}")
    return ids


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """Flags that write the canonical config; unset flags leave the file's values."""
    p.add_argument("model", nargs="?", default=None,
                   help=f"artifact of the bound deployment: a built-in model "
                        f"({', '.join(BUILTIN_MODELS)}), a local Hugging Face folder with "
                        f"tokenizer.json and model.safetensors or model.onnx, or a Hugging "
                        f"Face Hub id such as BAAI/bge-small-en-v1.5, read from the Hub cache "
                        f"($HF_HUB_CACHE or $HF_HOME/hub; downloaded there unless "
                        f"$HF_HUB_OFFLINE is set). An existing folder wins over a Hub id of "
                        f"the same spelling (default without --config: {DEFAULT_MODEL}; with "
                        f"--config, the file's artifact)")
    p.add_argument("--config", default=None, help="config.yaml (global.model_catalog ...)")
    p.add_argument("--platform", choices=["cpu", "cuda", "rocm"], default=None,
                   help="where -dp places workers")
    p.add_argument("-dp", "--data-parallel-size", dest="dp", type=_positive("-dp"),
                   default=None, help="independent worker processes (replicas) of the bound "
                                      "deployment")
    p.add_argument("--device-ids", type=_device_ids, default=None,
                   help="GPU ordinals for -dp, in order (repeat an id for several workers "
                        "on one device)")
    add_flags(p, DEPLOYMENT_SETTINGS)


def config_from_args(args: argparse.Namespace):
    """The canonical config: the file (if any) with the flags written into it."""
    from vllm_srun.runtime import device
    from vllm_srun.server.pool.config import load
    from vllm_srun.server.pool.flags import apply_flags

    base = load(args.config) if args.config else None
    gpu = args.platform in ("cuda", "rocm") or (base is not None and any(
        device.is_gpu(r.device or "cpu") for d in base.deployments.values()
        for r in d.placements()))
    return apply_flags(base, model=args.model, platform=args.platform, dp=args.dp,
                       device_ids=args.device_ids, settings=deployment_edits(args),
                       available=device.visible_devices() if gpu else {"cpu": 1})


def _add_threads_flags(p: argparse.ArgumentParser) -> None:
    add_flags(p, (MAX_THREADS, RECORD))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        fmt = log_format(getattr(args, "log_format", None))
    except ConfigError as exc:
        print(f"vllm-srun: error: {exc}", file=sys.stderr)
        return 2
    os.environ[LOG_FORMAT_ENV] = fmt  # worker processes log the same way
    configure_logging(getattr(args, "log_level", "info"), fmt)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per worker call otherwise
    try:
        if args.command == "serve":
            return serve(args, sys.argv[1:] if argv is None else argv)
        if args.command == "config":
            sys.stdout.write(config_from_args(args).to_yaml())
            return 0
        from vllm_srun.server.frontend.threads_cli import run_threads

        return run_threads(args)
    except RuntimeFault as exc:
        print(f"vllm-srun: error: {exc}", file=sys.stderr)
        return 2
    return 2


def _reexec_for_mkl_cbwr(args: argparse.Namespace, argv: list[str]) -> None:
    """``--mkl-cbwr``: MKL reads MKL_CBWR once, when torch loads, so start again with it."""
    if args.backend != BackendName.TORCH.value:
        raise ConfigError("--mkl-cbwr applies to the torch backend only (--backend torch)")
    if os.environ.get("MKL_CBWR") != "AUTO":
        os.execve(sys.executable, [sys.executable, "-P", "-m", "vllm_srun.server", *argv],
                  {**os.environ, "MKL_CBWR": "AUTO"})


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the workers start (connections queue from now)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        raise ConfigError(f"cannot bind --host {host} --port {port}: {exc}") from exc
    sock.listen(2048)
    return sock


def _checked_config(args: argparse.Namespace):
    """The canonical config, every check that can fail done before anything is bound."""
    from vllm_srun.runtime import device
    from vllm_srun.server.pool.config import check_placement
    from vllm_srun.server.pool.pool import dispatch_mode

    config = config_from_args(args)
    uses_gpu = any(device.is_gpu(r.device or "cpu") for d in config.deployments.values()
                   for r in d.placements())
    check_placement(config, device.visible_devices() if uses_gpu else {"cpu": 1})
    _check_deployments(config)  # fail fast on a bad MODEL or limits
    dispatch_mode()
    api_key(args.api_key)
    return config


def serve(args: argparse.Namespace, argv: list[str]) -> int:
    import uvicorn

    from vllm_srun.runtime.budget import configured_threads, cpu_budget
    from vllm_srun.runtime.placement import spread_threads
    from vllm_srun.server.frontend.app import ServerOptions, ServerState, create_app
    from vllm_srun.server.pool.pool import PoolOptions
    from vllm_srun.server.pool.replica_factory import (
        check_concurrent_forwards,
        fork_in_process_zygotes,
    )
    from vllm_srun.tuner.modes import effective_mode, learning_share, max_threads, parse_mode

    if args.mkl_cbwr:
        _reexec_for_mkl_cbwr(args, argv)
    config = _checked_config(args)
    budget, mode = cpu_budget(), parse_mode()
    spread_threads()  # read by each worker's lanes: a bad value is a start-up error here
    share = learning_share(args.learning_share)
    pool_options = PoolOptions(budget, int(mode), max_threads(budget, args.max_threads),
                               args.record, args.log_level, learning_share=share)
    check_concurrent_forwards(pool_options, config)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # R9.1: a spawned child of this process (the in-process worker's shadow process) starts as
    # `python -c`, which puts the working folder first on its module path unless told not to
    os.environ["PYTHONSAFEPATH"] = "1"
    fork_in_process_zygotes(pool_options, config)
    sock = _bind(args.host, args.port)
    failed: list[str] = []
    server_box: list = []

    def on_load_failure(reason: str) -> None:  # the in-process worker could not load
        failed.append(reason)
        if server_box:
            server_box[0].should_exit = True

    state = ServerState(config, pool_options,
                        ServerOptions(args.max_body_bytes, api_key(args.api_key)),
                        on_load_failure, (lambda: config_from_args(args)) if args.config
                        else None)
    server = uvicorn.Server(uvicorn.Config(
        create_app(state, gate=False), log_level="warning", access_log=False, log_config=None,
        http=state.admission.protocol(), loop="uvloop", timeout_graceful_shutdown=5))
    server_box.append(server)
    bound = config.deployments[config.bound]
    _announce(config, configured_threads(budget, bound.engine.num_threads), budget,
              int(effective_mode(bound.adaptive_threads, mode)), sock.getsockname()[:2])
    server.run(sockets=[sock])
    return 1 if failed else 0


def _announce(config, num_threads: int, budget: int, mode: int, address) -> None:
    """The one line a caller (and the tests) read: what is served, and where."""
    host, port = address
    bound = config.deployments[config.bound]
    replicas = len(bound.placements())
    shown = f"[{host}]" if ":" in host else host
    at_once = bound.engine.concurrent_forwards
    print(f"vllm-srun: serving {bound.artifact} (deployment {config.bound}, {replicas} "
          f"replica{'s' if replicas > 1 else ''}, backend {bound.backend or 'onnxruntime'}, "
          f"{num_threads} threads per CPU worker"
          f"{f' per forward, {at_once} forwards at once' if at_once > 1 else ''}, CPU budget "
          f"{budget}, adaptive threads mode {mode}) on http://{shown}:{port}", flush=True)
    log.info("server_listening url=http://%s:%d deployment=%s artifact=%s replicas=%d "
             "num_threads=%d concurrent_forwards=%d cpu_budget=%d adaptive_mode=%d", shown,
             port, config.bound, bound.artifact, replicas, num_threads, at_once, budget, mode)


def _check_deployments(config) -> None:
    """Resolve each managed deployment's artifact and check its set limits, naming the key."""
    from vllm_srun.runtime.artifact import resolve
    from vllm_srun.server.pool.config import check_endpoint_keys

    check_endpoint_keys(config)
    for name, dep in config.deployments.items():
        if all(r.endpoint for r in dep.placements()):
            continue
        key = f"global.model_catalog.deployments.{name}"
        try:
            manifest = resolve(dep.artifact, dep.revision)
        except RuntimeFault as exc:
            raise ConfigError(f"{key}.artifact: {exc}") from None
        tokens = dep.engine.max_num_batched_tokens
        if tokens is not None and tokens < manifest.max_tokens:
            raise ConfigError(f"{key}.engine.max_num_batched_tokens: {tokens} must be at least "
                              f"the model's max tokens ({manifest.max_tokens})")


if __name__ == "__main__":
    raise SystemExit(main())
