"""The ``vllm-srun`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from runtime.artifact import BUILTIN_MODELS, DEFAULT_MODEL
from runtime.errors import RuntimeFault
from runtime.types import BackendName

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-srun", description="Serve encoder models (embeddings, classifiers) on the CPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve", help="serve a model over HTTP",
        description="Serve one model over HTTP (OpenAI-compatible /v1/embeddings).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                       help=f"a built-in model ({', '.join(BUILTIN_MODELS)}) or a local Hugging "
                            "Face folder with tokenizer.json and model.safetensors or model.onnx")
    serve.add_argument("--backend", choices=[b.value for b in BackendName],
                       default=BackendName.ONNXRUNTIME.value,
                       help="CPU backend; onnxruntime exports the model to ONNX once per "
                            "revision into the cache")
    serve.add_argument("--threads", type=_positive("--threads"), default=None,
                       help="intra-op threads per forward (default: $VLLM_SRUN_CPU_THREADS, "
                            "else half the CPU budget in 1..16), capped by the CPU budget")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind")
    serve.add_argument("--port", type=_port, default=8000, help="port to bind (0 = any free)")
    serve.add_argument("--max-num-seqs", type=_positive("--max-num-seqs"), default=32,
                       help="most rows in one forward")
    serve.add_argument("--max-num-batched-tokens", type=_positive("--max-num-batched-tokens"),
                       default=8192, help="most padded tokens (rows x longest) in one forward")
    serve.add_argument("--timeout-ms", type=_positive("--timeout-ms"), default=30_000,
                       help="longest a request may take; a caller may ask for less with the "
                            "X-Request-Timeout-Ms header")
    serve.add_argument("--max-body-bytes", type=_positive("--max-body-bytes"),
                       default=4 * 1024 * 1024, help="largest request body accepted")
    serve.add_argument("--cache-entries", type=int, default=4096,
                       help="rows kept in the result cache (0 turns it off)")
    _add_threads_flags(serve)
    serve.add_argument("--mkl-cbwr", action="store_true",
                       help="torch backend: run with MKL_CBWR=AUTO (MKL's reproducible mode, "
                            "set before torch loads), which makes answers bit-identical across "
                            "thread counts on hosts where they otherwise drift")
    serve.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"], help="log level")
    from server.threads_cli import add_threads_commands

    add_threads_commands(sub, _add_threads_flags)
    return parser


def _add_threads_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-threads", type=_positive("--max-threads"), default=None,
                   help="adaptive threads: highest count to try (default: the configured count;"
                        " capped by the CPU budget; also $VLLM_SRUN_CPU_MAX_THREADS)")
    p.add_argument("--record", default=None,
                   help="host record file (default: $VLLM_SRUN_RECORD, else "
                        "host-record.sqlite in the user's data folder)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(args, "log_level", "info").upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        if args.command == "serve":
            return serve(args, sys.argv[1:] if argv is None else argv)
        from server.threads_cli import run_threads

        return run_threads(args)
    except RuntimeFault as exc:
        print(f"vllm-srun: error: {exc}", file=sys.stderr)
        return 2
    return 2


def serve(args: argparse.Namespace, argv: list[str]) -> int:
    import uvicorn

    from runtime.artifact import resolve
    from runtime.budget import configured_threads, cpu_budget
    from runtime.errors import ConfigError
    from runtime.runner import check_args
    from runtime.types import EngineArgs
    from server.app import ServerOptions, ServerState, create_app
    from server.deployment import Deployment, DeploymentSpec
    from tuner.modes import max_threads, parse_mode

    if args.mkl_cbwr:
        if args.backend != BackendName.TORCH.value:
            raise ConfigError("--mkl-cbwr applies to the torch backend only (--backend torch)")
        if os.environ.get("MKL_CBWR") != "AUTO":  # MKL reads it once, when torch loads
            os.execve(sys.executable, [sys.executable, "-m", "server.cli", *argv],
                      {**os.environ, "MKL_CBWR": "AUTO"})
    budget = cpu_budget()
    num_threads = configured_threads(budget, args.threads)
    mode = parse_mode()
    top = max_threads(budget, args.max_threads)
    if args.cache_entries < 0:
        raise ConfigError(f"--cache-entries must be >= 0, got {args.cache_entries}")
    engine_args = EngineArgs(num_threads=num_threads, max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             timeout_ms=args.timeout_ms, cache_entries=args.cache_entries)
    manifest = resolve(args.model)  # fail fast on a bad MODEL, before binding
    check_args(engine_args, manifest)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    deployment = Deployment(DeploymentSpec(args.model, args.backend, engine_args, budget, mode,
                                           top, args.record), manifest)

    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        raise ConfigError(f"cannot bind --host {args.host} --port {args.port}: {exc}") from exc
    sock.listen(2048)  # connections queue from now on, before the app starts accepting
    host, port = sock.getsockname()[:2]
    server_box: list[uvicorn.Server] = []

    def on_load_failure(_reason: str) -> None:
        if server_box:
            server_box[0].should_exit = True

    state = ServerState(deployment, ServerOptions(max_body_bytes=args.max_body_bytes,
                                      served_names=(args.model,)),
                        on_load_failure)
    config = uvicorn.Config(create_app(state), log_level="warning", access_log=False,
                            http="httptools", loop="uvloop", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server_box.append(server)
    shown = f"[{host}]" if ":" in host else host
    print(f"vllm-srun: serving {manifest.name} (backend {args.backend}, {num_threads} threads, "
          f"CPU budget {budget}, adaptive threads mode {int(mode)}) on http://{shown}:{port}",
          flush=True)
    state.load_in_background()
    server.run(sockets=[sock])
    return 1 if state.runner is None else 0


if __name__ == "__main__":
    raise SystemExit(main())
