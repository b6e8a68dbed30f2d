"""Write the local datasets of the lm-eval tasks in this folder (deterministic).

    python -m bench.compat.lmeval.make_data

No model hub is reachable here, and lm-evaluation-harness's stock tasks download
their data from one; these small tasks use facts written out below instead:

- ``chatsvc_mc`` (multiple choice, scored by log-likelihood): a country's capital
  among four, an adjective's opposite among four, a small sum among four.
- ``chatsvc_gen`` (generation until a newline, exact match): a country's capital,
  a small sum.

The files are committed; this script is how they were made (seeded: run it again and
they come out the same).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 18

CAPITALS = {
    "France": "Paris",
    "Germany": "Berlin",
    "Italy": "Rome",
    "Spain": "Madrid",
    "Portugal": "Lisbon",
    "Greece": "Athens",
    "Austria": "Vienna",
    "Poland": "Warsaw",
    "Hungary": "Budapest",
    "Sweden": "Stockholm",
    "Norway": "Oslo",
    "Denmark": "Copenhagen",
    "Finland": "Helsinki",
    "Ireland": "Dublin",
    "Belgium": "Brussels",
    "the Netherlands": "Amsterdam",
    "Switzerland": "Bern",
    "the Czech Republic": "Prague",
    "Romania": "Bucharest",
    "Bulgaria": "Sofia",
    "Serbia": "Belgrade",
    "Croatia": "Zagreb",
    "Ukraine": "Kyiv",
    "Russia": "Moscow",
    "Turkey": "Ankara",
    "Egypt": "Cairo",
    "Kenya": "Nairobi",
    "Nigeria": "Abuja",
    "Ghana": "Accra",
    "Ethiopia": "Addis Ababa",
    "Morocco": "Rabat",
    "Algeria": "Algiers",
    "Tunisia": "Tunis",
    "Senegal": "Dakar",
    "South Africa": "Pretoria",
    "Japan": "Tokyo",
    "China": "Beijing",
    "India": "New Delhi",
    "Pakistan": "Islamabad",
    "Bangladesh": "Dhaka",
    "Thailand": "Bangkok",
    "Vietnam": "Hanoi",
    "Indonesia": "Jakarta",
    "the Philippines": "Manila",
    "South Korea": "Seoul",
    "Malaysia": "Kuala Lumpur",
    "Iran": "Tehran",
    "Iraq": "Baghdad",
    "Saudi Arabia": "Riyadh",
    "Israel": "Jerusalem",
    "Jordan": "Amman",
    "Syria": "Damascus",
    "Lebanon": "Beirut",
    "Afghanistan": "Kabul",
    "Nepal": "Kathmandu",
    "Mongolia": "Ulaanbaatar",
    "Australia": "Canberra",
    "New Zealand": "Wellington",
    "Canada": "Ottawa",
    "the United States": "Washington",
    "Mexico": "Mexico City",
    "Cuba": "Havana",
    "Brazil": "Brasilia",
    "Argentina": "Buenos Aires",
    "Chile": "Santiago",
    "Peru": "Lima",
    "Colombia": "Bogota",
    "Venezuela": "Caracas",
    "Ecuador": "Quito",
    "Uruguay": "Montevideo",
    "Paraguay": "Asuncion",
    "Bolivia": "Sucre",
    "Iceland": "Reykjavik",
    "Estonia": "Tallinn",
    "Latvia": "Riga",
    "Lithuania": "Vilnius",
    "Slovakia": "Bratislava",
    "Slovenia": "Ljubljana",
    "Albania": "Tirana",
    "Cyprus": "Nicosia",
    "Malta": "Valletta",
    "Luxembourg": "Luxembourg",
    "Qatar": "Doha",
    "Kuwait": "Kuwait City",
    "Oman": "Muscat",
    "Yemen": "Sanaa",
    "Sri Lanka": "Colombo",
    "Myanmar": "Naypyidaw",
    "Cambodia": "Phnom Penh",
    "Laos": "Vientiane",
    "Uganda": "Kampala",
    "Tanzania": "Dodoma",
    "Zimbabwe": "Harare",
    "Zambia": "Lusaka",
    "Angola": "Luanda",
    "Sudan": "Khartoum",
    "Libya": "Tripoli",
    "Jamaica": "Kingston",
}

OPPOSITES = {
    "hot": "cold",
    "big": "small",
    "fast": "slow",
    "happy": "sad",
    "light": "dark",
    "up": "down",
    "open": "closed",
    "full": "empty",
    "early": "late",
    "hard": "soft",
    "high": "low",
    "long": "short",
    "old": "young",
    "rich": "poor",
    "strong": "weak",
    "thick": "thin",
    "wet": "dry",
    "loud": "quiet",
    "clean": "dirty",
    "cheap": "expensive",
    "easy": "difficult",
    "wide": "narrow",
    "deep": "shallow",
    "heavy": "light",
    "sharp": "dull",
    "safe": "dangerous",
    "true": "false",
    "good": "bad",
    "first": "last",
    "inside": "outside",
    "near": "far",
    "right": "wrong",
    "alive": "dead",
    "black": "white",
    "day": "night",
    "love": "hate",
    "push": "pull",
    "win": "lose",
    "buy": "sell",
    "give": "take",
    "begin": "end",
    "remember": "forget",
    "accept": "refuse",
    "arrive": "leave",
    "question": "answer",
    "north": "south",
    "east": "west",
    "front": "back",
    "top": "bottom",
    "increase": "decrease",
}


def multiple_choice(rng: random.Random) -> list[dict]:
    items = []
    capitals = sorted(set(CAPITALS.values()))
    for country, capital in CAPITALS.items():
        wrong = rng.sample([c for c in capitals if c != capital], 3)
        items.append(
            _mc(rng, f"Question: What is the capital of {country}?\nAnswer:", capital, wrong)
        )
    words = sorted(set(OPPOSITES.values()))
    for word, opposite in OPPOSITES.items():
        wrong = rng.sample([w for w in words if w not in (opposite, word)], 3)
        items.append(
            _mc(rng, f"Question: What is the opposite of '{word}'?\nAnswer:", opposite, wrong)
        )
    for a, b in _sums(rng):
        total = a + b
        wrong = rng.sample([n for n in range(2, 41) if n != total], 3)
        items.append(
            _mc(rng, f"Question: What is {a} + {b}?\nAnswer:", str(total), [str(n) for n in wrong])
        )
    return items


def _mc(rng: random.Random, question: str, right: str, wrong: list[str]) -> dict:
    choices = [right, *wrong]
    rng.shuffle(choices)
    return {
        "question": question,
        "choices": [f" {c}" for c in choices],
        "label": choices.index(right),
    }


def _sums(rng: random.Random) -> list[tuple[int, int]]:
    """100 different sums of two numbers from 1 to 20."""
    return rng.sample([(a, b) for a in range(1, 21) for b in range(1, 21)], 100)


def generation(rng: random.Random) -> list[dict]:
    items = [
        {"question": f"Question: What is the capital of {country}?\nAnswer:", "answer": capital}
        for country, capital in CAPITALS.items()
    ]
    for a, b in _sums(rng):
        items.append({"question": f"Question: What is {a} + {b}?\nAnswer:", "answer": str(a + b)})
    return items


def datasets() -> dict[str, list[dict]]:
    """Every data file's items, by file name."""
    return {
        "mc.jsonl": multiple_choice(random.Random(SEED)),
        "gen.jsonl": generation(random.Random(SEED + 1)),
    }


def as_jsonl(items: list[dict]) -> str:
    return "".join(json.dumps(item) + "\n" for item in items)


def main() -> None:
    folder = HERE / "data"
    folder.mkdir(exist_ok=True)
    for name, items in datasets().items():
        (folder / name).write_text(as_jsonl(items))
        print(f"{folder / name}: {len(items)} items")


if __name__ == "__main__":
    main()
