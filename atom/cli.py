"""``atom-engine``: serve | generate | router.

Engine flags carry vLLM's names and map one to one onto ``EngineConfig``
fields; a flag left out keeps ``EngineConfig``'s default, so the defaults
live in one place. Errors a user can cause (a bad flag or value, a missing
model folder) end in one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import errno
import json
import logging
import re
import sys
import time
from typing import Any, NoReturn

from atom.config import LOAD_FORMATS, EngineConfig, SpeculativeConfig

PROG = "atom-engine"
DEFAULT_SERVED_NAME = "default"  # served model name of the bundled default model

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}

# Flag dest -> EngineConfig field, where the names differ (vLLM's flag names win).
_FIELD_OF = {"num_gpu_blocks_override": "num_gpu_blocks"}
_ENGINE_DESTS = (
    "model", "tokenizer", "dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
    "enable_prefix_caching", "enable_chunked_prefill", "num_gpu_blocks_override", "kv_cache_memory", "seed",
    "device", "speculative_config", "async_scheduling", "kv_transfer_config", "enforce_eager", "num_scheduler_steps",
    "load_format",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line that names the flag, instead of argparse's usage block.
        self.exit(2, f"{PROG}: error: {message} (see `{self.prog} --help`)\n")


def _byte_size(text: str) -> int:
    """'1073741824', '512M', '2G', '1.5GiB' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use bytes or a suffix like 512M, 2G")
    scale = 1024 ** " kmgt".index(match.group(2).lower() or " ")
    return int(float(match.group(1)) * scale)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object ({{...}}), got {text!r}")
    return value


def _default(name: str) -> str:
    return f"(default: {_DEFAULTS[name]})"


def _engine_flags() -> argparse.ArgumentParser:
    parent = _Parser(add_help=False)
    g = parent.add_argument_group("engine options")
    g.add_argument("--model", metavar="PATH",
                   help="local Hugging Face checkpoint folder (config.json + *.safetensors); "
                        "default: a small random Kimi-Linear model built into ~/.cache/atom")
    g.add_argument("--tokenizer", metavar="PATH", help="tokenizer folder (default: the model folder)")
    g.add_argument("--load-format", choices=LOAD_FORMATS,
                   help="auto (or safetensors): the model folder's *.safetensors; dummy: random weights of "
                        f"config.json's shape, for benchmarks (the folder needs no weights) {_default('load_format')}")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"],
                   help=f"weight and activation dtype; auto follows the checkpoint {_default('dtype')}")
    g.add_argument("--max-num-seqs", type=int, metavar="N",
                   help=f"most requests running at once {_default('max_num_seqs')}")
    g.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                   help=f"token budget of one step {_default('max_num_batched_tokens')}")
    g.add_argument("--max-model-len", type=int, metavar="N",
                   help="most tokens (prompt + output) per request (default: the model's limit, at most 4096)")
    g.add_argument("--block-size", type=int, metavar="N",
                   help=f"tokens per KV-cache block {_default('block_size')}")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   help="reuse KV blocks of shared prompt prefixes (default: on; off for models with "
                        "recurrent state)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   help="split long prompts across steps (default: on)")
    g.add_argument("--num-gpu-blocks-override", type=int, metavar="N",
                   help="exact number of KV-cache blocks, instead of sizing them from memory")
    g.add_argument("--kv-cache-memory", type=_byte_size, metavar="BYTES",
                   help="memory for KV blocks and recurrent-state slots, in bytes or with a suffix "
                        "(512M, 2G; binary units) (default: room for max-num-seqs requests of max-model-len, at most "
                        "90%% of the GPU memory left after the model, or 1G on the CPU)")
    g.add_argument("--seed", type=int,
                   help=f"random seed; `generate` also seeds its prompt's sampling with it {_default('seed')}")
    g.add_argument("--device", help=f"torch device, e.g. cpu, cuda, cuda:1 {_default('device')}")
    g.add_argument("--speculative-config", type=_json_object, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' '
                        "(methods: ngram, mtp)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap: plan and queue the next step while the current one runs (default: on for "
                        "CUDA devices, MTP speculation included; off on the CPU and with n-gram drafting, "
                        "which drafts on the host after each step and ran slower with it)")
    g.add_argument("--num-scheduler-steps", type=int, metavar="K",
                   help="multi-step decoding: when every running request is decoding, run up to K decode "
                        "steps per scheduling round, so scheduling and output handling are paid once per K "
                        "tokens; with --async-scheduling they overlap the next round "
                        f"{_default('num_scheduler_steps')}")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="on a GPU, run decode steps eagerly instead of replaying captured CUDA graphs")
    g.add_argument("--kv-transfer-config", type=_json_object, metavar="JSON",
                   help='prefill/decode disaggregation, e.g. \'{"kv_connector": "mooncake", "kv_role": '
                        '"kv_producer", "protocol": "tcp", "handshake_port": 0}\' (roles: kv_producer, kv_consumer)')
    return parent


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="ATOM LLM inference engine.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate,router}")
    engine = _engine_flags()

    serve = sub.add_parser("serve", parents=[engine], help="run the OpenAI-compatible HTTP server",
                           description="Serve the model over an OpenAI-compatible HTTP API.")
    s = serve.add_argument_group("server options")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    s.add_argument("--api-key", help="require this bearer token on /v1 routes (default: $ATOM_API_KEY, else none)")
    s.add_argument("--served-model-name", metavar="NAME",
                   help="model name the API reports and accepts (default: the --model value, or "
                        f"'{DEFAULT_SERVED_NAME}' for the bundled default model)")
    s.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop even if uvloop is installed")
    serve.set_defaults(func=_serve)

    gen = sub.add_parser("generate", parents=[engine], help="generate text for one prompt, streamed to stdout",
                         description="Generate text for one prompt and stream it to stdout; a summary goes to stderr.")
    s = gen.add_argument_group("sampling options")
    s.add_argument("--prompt", required=True, help="the prompt text")
    s.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    s.add_argument("--temperature", type=float, default=1.0, help="sampling temperature; 0 is greedy (default: 1.0)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability mass (default: 1.0, off)")
    s.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default: 0, off)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.set_defaults(func=_generate)

    router = sub.add_parser("router", help="route OpenAI requests over prefill and decode servers (P/D)",
                            description="Run each request's prefill on a --prefill server (a kv_producer), "
                                        "then its decode on a --decode server (a kv_consumer), round-robin; "
                                        "stream the decode server's answer back.")
    r = router.add_argument_group("router options")
    r.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill server, e.g. http://127.0.0.1:8100 (repeat for several)")
    r.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode server, e.g. http://127.0.0.1:8200 (repeat for several)")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    r.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    r.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="most seconds one leg (prefill or decode, whole response) may take (default: 300)")
    r.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                   help="most seconds to connect to a backend (default: 10)")
    router.set_defaults(func=_router)
    return parser


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Only flags given on the command line reach EngineConfig; the rest keep its defaults."""
    kwargs = {_FIELD_OF.get(d, d): getattr(args, d) for d in _ENGINE_DESTS if getattr(args, d) is not None}
    if "model" not in kwargs:
        from atom.default_model import default_model_path

        kwargs["model"] = default_model_path()
        print(f"{PROG}: no --model given; using the bundled default model (random weights, gibberish text) "
              f"at {kwargs['model']}", file=sys.stderr)
    if "speculative_config" in kwargs:
        kwargs["speculative_config"] = _speculative_config(kwargs["speculative_config"])
    return EngineConfig(**kwargs)


def _speculative_config(spec: dict[str, Any]) -> SpeculativeConfig:
    known = [f.name for f in dataclasses.fields(SpeculativeConfig)]
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise ValueError(f"--speculative-config has unknown key(s) {unknown}; known keys: {', '.join(known)}")
    if "method" not in spec:
        raise ValueError("--speculative-config needs a \"method\" (\"ngram\" or \"mtp\")")
    return SpeculativeConfig(**spec)


# -- serve --------------------------------------------------------------------------
def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = engine_config_from_args(args)
    from atom.entrypoints.openai.server import run_server

    # Clients must send the served name as "model"; the default model's cache path is no name to type.
    name = args.served_model_name or (None if args.model else DEFAULT_SERVED_NAME)
    try:
        run_server(config, args.host, args.port, args.api_key, name, not args.no_uvloop)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise ValueError(f"{args.host}:{args.port} is already in use; pass another --port") from None
    return 0


# -- router -------------------------------------------------------------------------
def _router(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for url in args.prefill + args.decode:
        if not re.match(r"https?://[^/]+", url):
            raise ValueError(f"{url!r} is not a server URL; use one like http://127.0.0.1:8100")
    from atom.entrypoints.router import Router, run_router

    try:
        run_router(Router(args.prefill, args.decode, args.timeout, args.connect_timeout), args.host, args.port)
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        raise ValueError(f"{args.host}:{args.port} is already in use; pass another --port") from None
    return 0


# -- generate -----------------------------------------------------------------------
# C0 control characters other than \t and \n: a random model emits them, and raw
# they can garble a terminal (ESC sequences).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _generate(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from atom.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    config = engine_config_from_args(args)
    return asyncio.run(_stream(config, args.prompt, params))


async def _stream(config: EngineConfig, prompt: str, params) -> int:
    from atom.engine.async_engine import AsyncEngine

    tty = sys.stdout.isatty()
    async with AsyncEngine.from_config(config) as engine:
        start = time.perf_counter()
        num_tokens, reason = 0, None
        async for out in engine.generate(prompt, params):
            text = _CONTROL.sub("\ufffd", out.new_text) if tty else out.new_text
            sys.stdout.write(text)
            sys.stdout.flush()
            num_tokens += len(out.new_token_ids)
            reason = out.outputs[0].finish_reason
        elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"{num_tokens} tokens in {elapsed:.2f} s ({num_tokens / max(elapsed, 1e-9):.1f} tok/s), "
          f"finish_reason={reason}", file=sys.stderr)
    return 0


# -- entry point --------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="replace")
    try:
        return args.func(args)
    except ValueError as exc:  # a user's mistake: config, checkpoint, sampling params, prompt
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
