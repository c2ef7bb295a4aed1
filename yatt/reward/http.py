"""Remote reward source: items are scored by a server over HTTP (:class:`HttpReward`).

Protocol, for writing a server::

    POST <url>                Content-Type: application/json
    {"items": [{"prompt": "...", "response": "...", "row": {...}}, ...]}

    200 OK                    Content-Type: application/json
    {"scores": [1.0, 0.0, ...]}

A request holds at most ``batch_size`` items; the answer holds one finite number per item, in
item order. ``row`` is the item's data row (:class:`~yatt.reward.item.RewardItem`); values that
are not JSON-serialisable are sent as their ``str()``. Up to ``max_concurrency`` requests are in
flight at once per rank, so a server should expect ``max_concurrency`` x ranks concurrent requests.

A request is retried, with exponential backoff, on a connection error or dropped connection, a
time-out, HTTP 5xx or 429, a body that is not JSON, or JSON without a ``scores`` list of one value
per item; any other status (e.g. 400) is not retried. A batch whose attempts are all spent gets
``error_score`` for each item, and so does a single score that is not a finite number (the rest of
its batch keep theirs). A server fault never raises: :meth:`HttpReward.score` always returns one
score per item.
"""
from __future__ import annotations

import asyncio
import json
import random
import httpx

from yatt.reward.item import RewardItem, Scored, finite_score

COUNTERS = ("requests", "retries", "timeouts", "failed_batches")


class HttpReward:
    """Scores items by POSTing them, in batches, to a reward server (protocol: module docstring).

    Args:
        url: the server's endpoint, ``http://`` or ``https://``.
        batch_size: most items per request (>= 1).
        max_concurrency: most requests in flight at once, per :meth:`score` call (>= 1).
        timeout_s: time-out of a request in seconds (> 0), applied by httpx to each of connecting,
            sending, and waiting for each chunk of the answer.
        retries: attempts of a batch after its first one (>= 0).
        backoff_s: wait before the k-th retry, seconds (>= 0): ``backoff_s * 2**(k-1)``, plus up
            to 10 % jitter.
        error_score: the score of an item whose batch failed or whose score is not a finite number.

    Raises:
        ValueError: an argument is out of range; the message names it.
    """

    def __init__(self, url: str, batch_size: int = 32, max_concurrency: int = 4, timeout_s: float = 30.0,
                 retries: int = 3, backoff_s: float = 0.5, error_score: float = 0.0) -> None:
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError) as e:
            raise ValueError(f"url: not a valid URL: {url!r}") from e
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"url: must be http:// or https:// with a host, got {url!r}")
        for name, value, low in (("batch_size", batch_size, 1), ("max_concurrency", max_concurrency, 1),
                                 ("retries", retries, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: must be an int >= {low}, got {value!r}")
        if finite_score(timeout_s) is None or timeout_s <= 0:
            raise ValueError(f"timeout_s: must be a finite number > 0, got {timeout_s!r}")
        if finite_score(backoff_s) is None or backoff_s < 0:
            raise ValueError(f"backoff_s: must be a finite number >= 0, got {backoff_s!r}")
        if finite_score(error_score) is None:
            raise ValueError(f"error_score: must be a finite number, got {error_score!r}")
        self.url, self.batch_size, self.max_concurrency = url, batch_size, max_concurrency
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), retries, float(backoff_s)
        self.error_score = float(error_score)

    def score(self, items: list[RewardItem]) -> Scored:
        """Scores of ``items``, in item order; no request if ``items`` is empty.

        ``errors`` counts items that got ``error_score``; ``counters``: ``requests`` (HTTP attempts
        made), ``retries`` (attempts beyond a batch's first), ``timeouts`` (attempts that timed out),
        ``failed_batches`` (batches that got ``error_score`` after all attempts).

        Raises:
            RuntimeError: called from a running asyncio event loop (this runs its own).
        """
        if not items:
            return Scored([])
        counters = dict.fromkeys(COUNTERS, 0.0)
        batches = [items[i:i + self.batch_size] for i in range(0, len(items), self.batch_size)]
        results = asyncio.run(self._score_batches(batches, counters))
        scores = [s for batch in results for s in batch]
        errors = sum(s is None for s in scores)
        return Scored([self.error_score if s is None else s for s in scores], errors, counters)

    async def _score_batches(self, batches: list[list[RewardItem]],
                             counters: dict[str, float]) -> list[list[float | None]]:
        semaphore = asyncio.Semaphore(self.max_concurrency)
        n = self.max_concurrency  # a pooled connection per request in flight, kept open for the next batch
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s), limits=limits) as client:
            return await asyncio.gather(*(self._score_batch(client, semaphore, b, counters) for b in batches))

    async def _score_batch(self, client: httpx.AsyncClient, semaphore: asyncio.Semaphore,
                           batch: list[RewardItem], counters: dict[str, float]) -> list[float | None]:
        """The batch's scores (None: not a finite number), or all None once its attempts are spent."""
        body = json.dumps({"items": [{"prompt": it.prompt, "response": it.response, "row": it.row}
                                     for it in batch]}, default=str)
        for attempt in range(self.retries + 1):
            if attempt:
                counters["retries"] += 1
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1) * (1 + random.random() / 10))
            counters["requests"] += 1
            async with semaphore:
                try:
                    response = await client.post(self.url, content=body,
                                                 headers={"Content-Type": "application/json"})
                except httpx.TimeoutException:
                    counters["timeouts"] += 1
                    continue
                except httpx.RequestError:  # connection refused / dropped, bad encoding ...
                    continue
            if response.status_code == 429 or response.status_code >= 500:
                continue
            if not response.is_success:
                break
            try:
                scores = response.json().get("scores")
            except (ValueError, AttributeError):  # not JSON, or JSON but not an object
                continue
            if isinstance(scores, list) and len(scores) == len(batch):
                return [finite_score(s) for s in scores]
        counters["failed_batches"] += 1
        return [None] * len(batch)
