"""Generate the bundled demo task: English number words -> German number words.

    python data/make_numbers.py            # writes data/numbers/{train,validation,test}.jsonl

"three hundred forty-two thousand fifteen" -> "dreihundertzweiundvierzigtausendfünfzehn":
German puts the units before the tens ("zweiundvierzig", two-and-forty), so the model has to
reorder, and every answer is exactly checkable. Splits hold disjoint numbers below one million,
with every length from one to six digits equally common.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

EN_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
           "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen"]
EN_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
DE_ONES = ["null", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben", "acht", "neun", "zehn", "elf",
           "zwölf", "dreizehn", "vierzehn", "fünfzehn", "sechzehn", "siebzehn", "achtzehn", "neunzehn"]
DE_TENS = ["", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig", "siebzig", "achtzig", "neunzig"]
SIZES = {"train": 20000, "validation": 1000, "test": 1000}
SMALL_REPEATS = 40  # numbers below 100 are few (99) among 20,000: the training split repeats each of them


def english(n: int) -> str:
    if n < 20:
        return EN_ONES[n]
    if n < 100:
        return EN_TENS[n // 10] + ("-" + EN_ONES[n % 10] if n % 10 else "")
    if n < 1000:
        return EN_ONES[n // 100] + " hundred" + (" " + english(n % 100) if n % 100 else "")
    return english(n // 1000) + " thousand" + (" " + english(n % 1000) if n % 1000 else "")


def german(n: int) -> str:
    if n == 0:
        return "null"
    return _german(n, final=True)


def _german(n: int, final: bool) -> str:
    """German compounds: 'eins' only stands at the end ('einundzwanzig', 'einhunderteins')."""
    if n == 0:
        return ""
    if n < 20:
        return "eins" if n == 1 and final else ("ein" if n == 1 else DE_ONES[n])
    if n < 100:
        ones = n % 10
        return (("ein" if ones == 1 else DE_ONES[ones]) + "und" if ones else "") + DE_TENS[n // 10]
    if n < 1000:
        return ("ein" if n // 100 == 1 else DE_ONES[n // 100]) + "hundert" + _german(n % 100, final)
    return _german(n // 1000, final=False) + "tausend" + _german(n % 1000, final)


def main(out: Path = Path(__file__).parent / "numbers", seed: int = 1234) -> None:
    rng = random.Random(seed)
    numbers, seen = [], set()
    while len(numbers) < sum(SIZES.values()):  # as many short numbers as long ones: digits 1..6 uniform
        digits = rng.randint(1, 6)
        n = rng.randrange(10 ** (digits - 1), 10 ** digits)
        if n not in seen:
            seen.add(n)
            numbers.append(n)
    out.mkdir(parents=True, exist_ok=True)
    start = 0
    for split, size in SIZES.items():
        chosen = numbers[start:start + size]
        if split == "train":
            chosen += [n for n in chosen if n < 100] * (SMALL_REPEATS - 1)
        with (out / f"{split}.jsonl").open("w") as f:
            for n in chosen:
                f.write(json.dumps({"en": english(n), "de": german(n), "value": n}, ensure_ascii=False) + "\n")
        start += size


if __name__ == "__main__":
    main()
