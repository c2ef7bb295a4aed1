"""Writes this folder's train.jsonl and eval.jsonl: one-step word problems in a schema of our own
(``problem``, ``solution``, ``kind``), the kind of file a user brings. Deterministic (seed 0).

    python examples/own_data/make_data.py
"""
import json
import random
from pathlib import Path

NAMES = ["Tom", "Sara", "Ali", "Mia", "Ken", "Lea", "Omar", "Ana", "Raj", "Zoe"]
THINGS = ["apples", "pencils", "marbles", "stickers", "books", "cards", "coins", "shells"]
ADD = ["{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?",
       "{n} had {a} {t}. A friend gave {n} {b} more. How many {t} does {n} have?",
       "There are {a} {t} in a box and {n} puts in {b} more. How many {t} are in the box?"]
SUB = ["{n} has {a} {t} and gives away {b}. How many {t} does {n} have left?",
       "{n} had {a} {t} and lost {b} of them. How many {t} are left?",
       "There are {a} {t} on a table and {n} takes {b}. How many {t} stay on the table?"]


def rows(count: int, rng: random.Random) -> list[dict]:
    out = []
    for _ in range(count):
        kind = rng.choice(["add", "sub"])
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        if kind == "sub" and b > a:
            a, b = b, a
        text = rng.choice(ADD if kind == "add" else SUB).format(n=rng.choice(NAMES), t=rng.choice(THINGS), a=a, b=b)
        out.append({"problem": text, "solution": a + b if kind == "add" else a - b, "kind": kind})
    return out


def main() -> None:
    rng, here = random.Random(0), Path(__file__).parent
    train = rows(600, rng)
    seen = {r["problem"] for r in train}
    held_out = [r for r in rows(400, rng) if r["problem"] not in seen][:150]
    for name, data in (("train.jsonl", train), ("eval.jsonl", held_out)):
        (here / name).write_text("".join(json.dumps(r) + "\n" for r in data))
        print(f"{here / name}: {len(data)} rows")


if __name__ == "__main__":
    main()
