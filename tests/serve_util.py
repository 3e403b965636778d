"""Helpers for the server tests: a tiny model behind a real uvicorn server on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from conftest import tiny_model

VOCAB = 49152  # the embedded tokenizer's vocabulary, so real text round-trips


def embedded_tokenizer():
    from transformers import AutoTokenizer

    from medusa.model import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("default"))


def tiny_runtime(tokenizer, seed: int = 0, heads: bool = True):
    """A Runtime over a tiny random Llama with the embedded tokenizer and random Medusa heads."""
    from medusa.engine import Engine
    from medusa.heads import HeadsConfig, MedusaHeads
    from medusa.runtime import Runtime, eos_ids
    from medusa.transformer import Transformer

    model = tiny_model("llama", seed=seed, vocab=VOCAB)
    model.config.eos_token_id = tokenizer.eos_token_id
    medusa_heads = None
    if heads:
        torch.manual_seed(seed)
        medusa_heads = MedusaHeads(HeadsConfig(model.config.hidden_size, VOCAB, 4, 1))
        for p in medusa_heads.parameters():
            torch.nn.init.normal_(p, std=0.3)
        medusa_heads = medusa_heads.attach(model)
    transformer = Transformer(model)
    engine = Engine(transformer, eos_ids(model, tokenizer))
    return Runtime(model, tokenizer, transformer, engine, medusa_heads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(app, timeout: float = 30.0) -> Iterator[str]:
    """Serve `app` with uvicorn in a thread; yields the base URL; stops the server afterwards."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=timeout)
