"""`medusa distill --server URL`: the answers come from an OpenAI-compatible server (vLLM, SGLang,
llama.cpp's server, TGI, `medusa serve`) serving the target, so a cluster's inference engine does the
generation and this process only tokenises and writes shards.

Each prompt is one greedy chat completion (`temperature: 0`, `max_tokens: data.max_new_tokens`), up to
`concurrency` in flight. The answer's text is tokenised with the target's own tokenizer (servers return
text, not ids), and the end-of-turn token is appended when the server says the answer stopped by itself,
as the target's own greedy answer ends. A request the server refuses (4xx: a prompt over its context, say)
is kept as an empty answer with finish_reason `refused:<status>` (training skips answers that short); one
that keeps failing (connection errors, 5xx, after `RETRIES` tries with back-off) stops the run with the
server named, and the shards finished so far stay.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from medusa.decoding.outputs import Finished
from medusa.errors import MedusaError

RETRIES = 4
TIMEOUT_S = 900.0  # one answer of a slow server at full load


def base_url(url: str) -> str:
    """`http://host:port`, with or without a trailing `/v1`, as the root the API paths hang from."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise MedusaError(f"--server: {url!r} is not an http(s) URL")
    return url.removesuffix("/v1")


def served_model(url: str, api_key: str | None = None, name: str | None = None) -> str:
    """The model id requests name: `name`, or the first (usually only) model the server lists."""
    import httpx

    if name:
        return name
    try:
        r = httpx.get(f"{base_url(url)}/v1/models", headers=_headers(api_key), timeout=30)
        r.raise_for_status()
        models = r.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise MedusaError(f"--server: cannot list the models of {url}: {exc}") from None
    if not models:
        raise MedusaError(f"--server: {url} serves no model")
    return models[0]["id"]


def check_same_tokenizer(url: str, model: str, tokenizer, prompt: str, prompt_ids: list[int],
                         api_key: str | None = None, slack: int = 3) -> None:
    """Refuse a server whose model does not tokenise as the target does (another model, another
    tokenizer): one short greedy answer to `prompt`, whose token counts the server reports (`usage`), must
    match what the target's tokenizer makes of the same chat and answer, within `slack` tokens."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24,
            "temperature": 0}
    try:
        r = httpx.post(f"{base_url(url)}/v1/chat/completions", json=body, headers=_headers(api_key), timeout=TIMEOUT_S)
        r.raise_for_status()
        data = r.json()
    except (httpx.HTTPError, ValueError) as exc:
        raise MedusaError(f"--server: {url} did not answer a probe prompt: {exc}") from None
    usage = data.get("usage") or {}
    text = (data["choices"][0]["message"].get("content") or "")
    ours = (len(prompt_ids), len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    theirs = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
    if None in theirs:
        return  # a server that reports no usage cannot be checked this way
    if abs(theirs[0] - ours[0]) > slack or abs(theirs[1] - ours[1]) > slack:
        raise MedusaError(f"--server: {url} serves {model!r}, which does not tokenise as the target does: a probe "
                          f"chat is {theirs[0]} prompt + {theirs[1]} answer tokens there and {ours[0]} + {ours[1]} "
                          "with the target's tokenizer; serve the target, or set the config's model to the "
                          "served one")


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def answer_all_served(url: str, model: str, prompts: list[str], max_new_tokens: int, tokenizer, concurrency: int,
                      on_finish: Callable[[Finished], None], progress=None, api_key: str | None = None) -> None:
    """Ask the server for every prompt's greedy answer; `on_finish(Finished(id=index, tokens, reason))`
    hears of each as it arrives (in any order)."""
    if concurrency < 1:
        raise MedusaError(f"--concurrency must be at least 1, got {concurrency}")
    eos = tokenizer.eos_token_id
    asyncio.run(_ask_all(base_url(url), model, prompts, max_new_tokens, concurrency, api_key,
                         lambda i, text, reason: on_finish(_finished(i, text, reason, tokenizer, eos, max_new_tokens,
                                                                     progress))))


def _finished(i: int, text: str, reason: str, tokenizer, eos: int | None, limit: int, progress) -> Finished:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:limit] if text else []
    if reason == "stop" and eos is not None and len(ids) < limit:
        ids.append(eos)
    if progress is not None:
        progress.update(len(ids))
    return Finished(i, ids, reason if reason in ("stop", "length") or reason.startswith("refused") else "stop")


async def _ask_all(url: str, model: str, prompts: list[str], max_new_tokens: int, concurrency: int,
                   api_key: str | None, done: Callable[[int, str, str], None]) -> None:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=TIMEOUT_S, limits=limits, headers=_headers(api_key)) as http:
        async def one(i: int) -> None:
            async with gate:
                text, reason = await _ask(http, url, model, prompts[i], max_new_tokens)
            done(i, text, reason)

        tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()


async def _ask(http, url: str, model: str, prompt: str, max_new_tokens: int) -> tuple[str, str]:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_new_tokens,
            "temperature": 0, "top_p": 1, "stream": False}
    problem = ""
    for attempt in range(RETRIES):
        try:
            r = await http.post(f"{url}/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            problem = f"{type(exc).__name__}: {exc}"
        else:
            if r.status_code == 200:
                choice = r.json()["choices"][0]
                return choice["message"].get("content") or "", choice.get("finish_reason") or "stop"
            if 400 <= r.status_code < 500 and r.status_code not in (408, 429):
                return "", f"refused:{r.status_code}"
            problem = f"HTTP {r.status_code}: {r.text[:200]}"
        await asyncio.sleep(min(2 ** attempt, 30))
    raise MedusaError(f"--server: {url} failed {RETRIES} times on one prompt ({problem}); the shards finished "
                      "so far are kept, re-run to go on")
