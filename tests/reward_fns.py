"""Reward functions for tests/test_reward_sources.py, loaded by import path (``reward_fns:name``)."""
import asyncio
import time


def length(prompt, response, row):
    return float(len(response))


def uses_row(prompt, response, row):
    """Reads a field the data row carries besides question and answer."""
    return float(response == row["expected"]) * row["scale"]


def lengths(prompts, responses, rows):
    return [float(len(r)) for r in responses]


def short_batch(prompts, responses, rows):
    return [1.0] * (len(responses) - 1)


async def async_length(prompt, response, row):
    await asyncio.sleep(0.01)
    return len(response)


async def async_lengths(prompts, responses, rows):
    return [len(r) for r in responses]


def odd_values(prompt, response, row):
    """A different failure per response: its text names it."""
    if response == "raise":
        raise KeyError("no such field")
    if response == "sleep":
        time.sleep(5.0)
        return 1.0
    return {"nan": float("nan"), "inf": float("inf"), "str": "0.5", "bool": True, "none": None}.get(response, 0.25)


async def async_slow(prompt, response, row):
    await asyncio.sleep(1.0 if response == "sleep" else 0.0)
    return 0.75


not_callable = 3


def parity(prompt, response, row):
    """1 for an odd sum of character codes: a group of n random responses carries no signal with
    probability 2 / 2**n, so dynamic sampling refills now and then."""
    return float(sum(map(ord, response)) % 2)
