"""`medusa serve`: start the OpenAI-compatible server."""

from __future__ import annotations

import argparse
import logging

from medusa.errors import MedusaError
from medusa.decoding.target.hardware import DTYPE_CHOICES

from medusa.serve.config import ServeConfig, load_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    p.add_argument("--config", default=None, help="YAML file (configs/serve/*.yaml); flags override it")
    p.add_argument("--model", default=None, help="'default' (embedded model), a model directory, .gguf or hub id")
    p.add_argument("--heads", default=None, help="heads directory, 'default' (shipped), 'medusa' or "
                   "'feature' (shipped heads of that kind) or 'none'")
    p.add_argument("--draft", default=None, help="draft model (shares the target's tokenizer) for draft speculation")
    p.add_argument("--retrieval", default=None, choices=["on", "off"], help="graft drafts from the text itself "
                   "into the heads' dynamic trees (config retrieval, default on)")
    p.add_argument("--datastore", default=None, help="a corpus retrieval also drafts from (config datastore)")
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES, metavar="{auto,bf16,fp16,fp32}")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None, help="engine CPU threads (default: cores - 1)")
    p.add_argument("--host", default=None, help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the model's name)")
    p.add_argument("--max-model-len", "--max-context", dest="max_context", type=int, default=None,
                   help="prompt + completion tokens per request (config max_context, default 2048)")
    p.add_argument("--max-num-seqs", "--max-batch", dest="max_batch", type=int, default=None,
                   help="rows decoded together (config max_batch, default 32)")
    p.add_argument("--prefill-tokens-per-step", "--max-num-batched-tokens", dest="prefill_tokens_per_step",
                   default=None, metavar="N|auto", help="prompt tokens prefilled per step boundary (default auto: "
                   "a prefill pass takes at most --prefill-stall x a decode pass; long prompts go in chunks)")
    p.add_argument("--prefill-stall", type=float, default=None, metavar="X",
                   help="auto prefill: a prefill pass may take X times the running rows' decode pass (default 1)")
    p.add_argument("--tpot-slo", default=None, metavar="MS|Nx",
                   help="step time running streams keep while prompts are prefilled: ms (80ms, 80) or a multiple "
                        "of a stream's step alone (2x); each step's prefill chunk fills the rest (default 2x)")
    p.add_argument("--prefix-cache", default=None, choices=["on", "off"],
                   help="reuse the K/V of prompt prefixes seen before: system prompts, earlier turns (config "
                        "prefix_cache, default on)")
    p.add_argument("--prefix-cache-mb", type=float, default=None, metavar="MB",
                   help="the prefix cache's memory budget (default: min(10%% of available memory, 2 GiB))")
    p.add_argument("--kernel-cache-entries", type=int, default=None, metavar="N",
                   help="compiled CPU kernels kept per matrix shape, in each of oneDNN's two caches: memory grows "
                        "by a few hundred KB per entry until they are full (config kernel_cache_entries, default "
                        "1024 each; a value set in the environment wins)")
    p.add_argument("--batch-invariant", default=None, choices=["on", "off"],
                   help="a request's tokens never depend on the others in its batch, in bf16 too (config "
                        "batch_invariant, default off: it costs speed)")
    p.add_argument("--chunked-prefill", default=None, choices=["on", "off"],
                   help="prefill prompts longer than the budget in chunks between steps (default on)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* (default: "
                   "$MEDUSA_API_KEY if set); /health and /metrics stay open")
    p.add_argument("--header-timeout", dest="header_timeout_s", type=float, default=None, metavar="S",
                   help="close a connection whose request headers take longer than S seconds (default 10)")
    p.add_argument("--body-timeout", dest="body_timeout_s", type=float, default=None, metavar="S",
                   help="answer 408 when a request body takes longer than S seconds (default 30)")
    p.add_argument("--keepalive-timeout", dest="keepalive_timeout_s", type=float, default=None, metavar="S",
                   help="close an idle keep-alive connection after S seconds (default 5)")
    p.add_argument("--max-header-bytes", type=int, default=None, metavar="N",
                   help="largest request line + headers accepted, 431 beyond (default 16384)")
    p.add_argument("--allow-host", dest="allowed_hosts", action="append", default=None, metavar="NAME",
                   help="a further Host name accepted on a loopback server without an API key (repeatable; "
                        "localhost, 127.0.0.1 and [::1] always are)")
    p.add_argument("--cors-origin", dest="cors_origins", action="append", default=None, metavar="ORIGIN",
                   help="let pages from ORIGIN (scheme://host[:port]) call the server, with CORS headers "
                        "(repeatable; default: none, CORS off)")
    p.add_argument("--policy", default=None, choices=["dynamic", "heads", "draft", "plain", "medusa"],
                   help="speculation policy (default dynamic); medusa: the earlier name of heads")
    p.add_argument("--cost-model", default=None, help="evaluator cost-model JSON for the dynamic policy")
    p.add_argument("--docs", action="store_true", default=None,
                   help="serve the OpenAPI schema and its pages (/openapi.json, /docs, /redoc)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    keys = ("model", "heads", "draft", "datastore", "dtype", "device", "threads", "host", "port", "docs", "served_model_name",
            "max_context", "max_batch", "api_key", "header_timeout_s", "body_timeout_s", "keepalive_timeout_s",
            "prefill_tokens_per_step", "prefill_stall", "max_header_bytes", "allowed_hosts", "cors_origins",
            "tpot_slo", "prefix_cache_mb", "kernel_cache_entries")
    overrides = {k: getattr(args, k) for k in keys}
    overrides["retrieval"] = None if args.retrieval is None else args.retrieval == "on"
    overrides["chunked_prefill"] = None if args.chunked_prefill is None else args.chunked_prefill == "on"
    overrides["batch_invariant"] = None if args.batch_invariant is None else args.batch_invariant == "on"
    overrides["prefix_cache"] = None if args.prefix_cache is None else args.prefix_cache == "on"
    cfg = load_config(args.config, overrides)
    if args.policy or args.cost_model:
        policy = cfg.policy.model_dump()
        policy.update({k: v for k, v in (("mode", args.policy), ("cost_model", args.cost_model)) if v})
        cfg = load_config(None, {**cfg.model_dump(), "policy": policy})
    if cfg.port == 0:
        raise MedusaError("--port: 0 is not a port to serve on; pick one, e.g. 8000")
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import uvicorn

    from medusa.serve.app import create_app
    from medusa.serve.connection import uvicorn_config

    from medusa.decoding.target.hardware import limit_kernel_caches

    caps = limit_kernel_caches(cfg.kernel_cache_entries)  # before the model's first oneDNN kernel
    logging.getLogger("serve").info("compiled-kernel caches: %s", ", ".join(f"{k}={v}" for k, v in caps.items()))
    set_engine_threads(cfg)
    app = create_app(cfg)
    uvicorn.Server(uvicorn_config(app, cfg, host=cfg.host, port=cfg.port, log_level=cfg.log_level)).run()
    return 0


def set_engine_threads(cfg: ServeConfig) -> None:
    import os

    import torch

    from medusa.decoding.target.model import default_device

    if torch.device(cfg.device or default_device()).type != "cpu":
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    threads = cfg.threads or max(1, cores - 1)
    torch.set_num_threads(threads)
    logging.getLogger("serve").info("engine uses %d CPU thread(s)", threads)
