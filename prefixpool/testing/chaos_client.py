"""The chaos and load client: a bounded OpenAI workload, the cold-output oracle and the verdict.

    client  = ApiClient(router_url, api_key)            aiohttp, one session
    oracle  = await Oracle.build(client, prompts)       prompt -> output with a fresh cache_salt
    outcomes = await steady_load(client, prompts, stop, concurrency=4, max_requests=400)
    tally   = Tally.of(outcomes, oracle)                served / clean failures / dirty / wrong

A fresh `cache_salt` puts a request in a namespace no block was ever stored
in, so it is computed from scratch: with greedy sampling (temperature 0) that
output is the truth every answered request must equal. In bfloat16 (or fp16)
with --batch-invariant, a client made with `logprobs=1` asks every answer's
per-token logprobs and the oracle compares them too, float for float (in
float32 they agree only to rounding, so leave it off). A clean failure is a
503 or a 4xx carrying an OpenAI error JSON; anything else is dirty. Knows
nothing of processes or faults: scripts/chaos.py and the tests inject those.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

SYSTEM_PROMPTS = (
    "You are a careful assistant. Answer briefly and cite the manual section. ",
    "Translate the following customer message into plain English, keep names as they are. ",
    "Summarise the log excerpt below; list each failing component once, by name. ",
)


def workload(num_prompts: int, suffix_chars: int = 24) -> list[str]:
    """Prompts that share a few long prefixes (so blocks are reused and fetched) with distinct tails."""
    prompts = []
    for i in range(num_prompts):
        tail = f"request {i:04d}: " + ("abcdefghij" * 20)[i % 7: i % 7 + suffix_chars]
        prompts.append(SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)] + tail)
    return prompts


@dataclass
class Outcome:
    prompt: str
    status: int
    text: str | None = None  # None unless the request was answered in full
    error: dict | None = None
    usage: dict | None = None
    ttft_s: float | None = None
    salt: str = ""
    logprobs: list[float] | None = None  # the sampled tokens' logprobs, when the client asked for them

    @property
    def answered(self) -> bool:
        return self.status == 200 and self.text is not None

    @property
    def not_taken(self) -> bool:
        """The router never took the request: refused or reset the connection before answering anything,
        or answered 503 router_draining."""
        error = self.error if isinstance(self.error, dict) else {}
        code = error.get("error", {}).get("code") if isinstance(error.get("error"), dict) else None
        return (self.status == 0 and "connect" in error) or (self.status == 503 and code == "router_draining")

    @property
    def clean_failure(self) -> bool:
        """503 or 4xx, with an OpenAI-style error object carrying a message."""
        message = (self.error or {}).get("error", {}).get("message") if isinstance(self.error, dict) else None
        return (self.status == 503 or 400 <= self.status < 500) and isinstance(message, str) and bool(message)


class ApiClient:
    def __init__(self, base_url: str, api_key: str = "", timeout_s: float = 120.0, keep_alive: bool = True,
                 logprobs: int | None = None) -> None:
        self.base_url = base_url
        self.logprobs = logprobs  # asked of every completion: the oracle then compares logprobs exactly
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        connector = aiohttp.TCPConnector(force_close=not keep_alive)
        self.session = aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                             connector=connector)

    async def close(self) -> None:
        await self.session.close()

    async def get_json(self, path: str) -> tuple[int, dict]:
        async with self.session.get(self.base_url + path) as response:
            return response.status, await response.json(content_type=None)

    async def post_json(self, path: str, body: dict) -> tuple[int, dict]:
        async with self.session.post(self.base_url + path, json=body) as response:
            return response.status, await response.json(content_type=None)

    async def complete(self, prompt: str, salt: str = "", max_tokens: int = 8, stream: bool = False) -> Outcome:
        return await self.complete_at(self.base_url, prompt, salt, max_tokens, stream)

    async def complete_at(self, base_url: str, prompt: str, salt: str = "", max_tokens: int = 8,
                          stream: bool = False) -> Outcome:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "cache_salt": salt}
        if self.logprobs is not None:
            body["logprobs"] = self.logprobs
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        answering = False
        try:
            async with self.session.post(base_url + "/v1/completions", json=body) as response:
                answering = True
                if response.status != 200 or not stream:
                    payload = await response.json(content_type=None)
                    if response.status != 200:
                        return Outcome(prompt, response.status, error=payload, salt=salt)
                    choice = payload["choices"][0]
                    return Outcome(prompt, 200, choice["text"], usage=payload["usage"],
                                   ttft_s=time.perf_counter() - started, salt=salt, logprobs=_token_logprobs(choice))
                return await _read_stream(prompt, salt, response, started)
        except aiohttp.ClientConnectorError as err:  # nothing was sent
            return Outcome(prompt, 0, error={"connect": repr(err)}, salt=salt)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError) as err:
            # reset before any response byte: the request sat in a closing listener's backlog, never taken
            return Outcome(prompt, 0, error={"connect" if not answering else "transport": repr(err)}, salt=salt)
        except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as err:
            return Outcome(prompt, 0, error={"transport": repr(err)}, salt=salt)


class BalancedClient(ApiClient):
    """One client over several routers, as a load balancer in front of them: round robin, a fresh
    connection per request, and a request a router did not take (connection refused or reset before
    any response byte, or a 503 `router_draining`) goes to the next router, as a balancer retrying on
    connect-failure and reset-before-response would. A request a router answered is never sent twice."""

    def __init__(self, base_urls: list[str], api_key: str = "", timeout_s: float = 120.0,
                 max_tries: int = 8, retry_pause_s: float = 0.05) -> None:
        super().__init__(base_urls[0], api_key, timeout_s, keep_alive=False)
        self.base_urls = list(base_urls)
        self.max_tries = max_tries
        self.retry_pause_s = retry_pause_s
        self.num_redirected = 0
        self._turn = 0

    async def complete(self, prompt: str, salt: str = "", max_tokens: int = 8, stream: bool = False) -> Outcome:
        self._turn += 1
        for attempt in range(self.max_tries):
            url = self.base_urls[(self._turn + attempt) % len(self.base_urls)]
            outcome = await self.complete_at(url, prompt, salt, max_tokens, stream)
            if not outcome.not_taken:
                return outcome
            self.num_redirected += 1
            await asyncio.sleep(self.retry_pause_s)
        return outcome


async def _read_stream(prompt: str, salt: str, response: aiohttp.ClientResponse, started: float) -> Outcome:
    parts, usage, ttft, logprobs = [], None, None, []
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if "error" in chunk:  # broken off mid-stream: not an answer
            return Outcome(prompt, 200, None, error=chunk, salt=salt)
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", ()):
            if choice.get("text"):
                ttft = ttft if ttft is not None else time.perf_counter() - started
                parts.append(choice["text"])
            logprobs += _token_logprobs(choice) or []
    return Outcome(prompt, 200, "".join(parts), usage=usage, ttft_s=ttft, salt=salt, logprobs=logprobs or None)


def _token_logprobs(choice: dict) -> list[float] | None:
    return choice["logprobs"]["token_logprobs"] if choice.get("logprobs") else None


class Oracle:
    """Cold outputs: each prompt once, in its own fresh salt namespace (computed, never reused). Built by a
    client that asks logprobs, it holds the cold logprobs too, and an answer must match them exactly."""

    def __init__(self, cold: dict[str, str], cold_logprobs: dict[str, list[float]] | None = None) -> None:
        self.cold = cold
        self.cold_logprobs = cold_logprobs or {}

    @classmethod
    async def build(cls, client: ApiClient, prompts: list[str], max_tokens: int = 8) -> "Oracle":
        cold, cold_logprobs = {}, {}
        for prompt in dict.fromkeys(prompts):
            outcome = await client.complete(prompt, salt=uuid.uuid4().hex, max_tokens=max_tokens)
            assert outcome.answered, f"oracle request failed: {outcome}"
            assert outcome.usage["prompt_tokens_details"]["cached_tokens"] == 0, "a fresh salt must compute"
            cold[prompt] = outcome.text
            if outcome.logprobs is not None:
                cold_logprobs[prompt] = outcome.logprobs
        return cls(cold, cold_logprobs)

    def wrong(self, outcome: Outcome) -> bool:
        if not outcome.answered:
            return False
        expected = self.cold_logprobs.get(outcome.prompt)
        return outcome.text != self.cold[outcome.prompt] or (expected is not None and outcome.logprobs != expected)


@dataclass
class Tally:
    requests: int = 0
    served: int = 0
    clean_failures: int = 0
    dirty: list[Outcome] = field(default_factory=list)
    wrong: list[Outcome] = field(default_factory=list)
    cached_tokens: int = 0
    fetched_tokens: int = 0

    @classmethod
    def of(cls, outcomes: list[Outcome], oracle: Oracle) -> "Tally":
        tally = cls(requests=len(outcomes))
        for outcome in outcomes:
            if outcome.answered:
                tally.served += 1
                tally.cached_tokens += outcome.usage["prompt_tokens_details"]["cached_tokens"]
                tally.fetched_tokens += outcome.usage.get("prefixpool", {}).get("fetched_tokens", 0)
                if oracle.wrong(outcome):
                    tally.wrong.append(outcome)
            elif outcome.clean_failure:
                tally.clean_failures += 1
            else:
                tally.dirty.append(outcome)
        return tally

    def __add__(self, other: "Tally") -> "Tally":
        return Tally(self.requests + other.requests, self.served + other.served,
                     self.clean_failures + other.clean_failures, self.dirty + other.dirty, self.wrong + other.wrong,
                     self.cached_tokens + other.cached_tokens, self.fetched_tokens + other.fetched_tokens)


async def steady_load(client: ApiClient, prompts: list[str], stop: asyncio.Event, concurrency: int = 3,
                      max_requests: int = 500, stream_every: int = 3, max_tokens: int = 8, salt: str = "",
                      pause_s: float = 0.0) -> list[Outcome]:
    """`concurrency` clients looping over `prompts` (resting `pause_s` between requests) until `stop`
    is set or `max_requests` were sent."""
    outcomes: list[Outcome] = []
    counter = iter(range(max_requests))

    async def one_client() -> None:
        for i in counter:
            if stop.is_set():
                return
            stream = stream_every > 0 and i % stream_every == 0
            prompt = prompts[i % len(prompts)]
            outcomes.append(await client.complete(prompt, salt=salt, max_tokens=max_tokens, stream=stream))
            await asyncio.sleep(pause_s)

    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return outcomes
