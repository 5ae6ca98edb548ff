"""Per-call time and verdicts of the ``math`` and ``math_verify`` scorers on 200 generated MATH-like samples
(half right but written in another notation, half wrong): ``python bench/math_scorers.py [SEED] [--misses]``.

Prints, for each scorer, the median and the slowest call and how many of the 200 verdicts are right; the
README quotes the medians over seeds 0-4.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from rlplat_rewards import hendrycks_math, math_verify_scorer


def answer_pair(rng: random.Random):
    """(ground truth, an equivalent way to write it, a wrong answer)"""
    kind = rng.randrange(8)
    a, b = rng.randint(2, 40), rng.randint(2, 40)
    if kind == 0:
        return str(a * b), f"{a * b}", str(a * b + 1)
    if kind == 1:
        return f"\\frac{{{a}}}{{{b}}}", f"\\dfrac{{{2 * a}}}{{{2 * b}}}", f"\\frac{{{b}}}{{{a + b}}}"
    if kind == 2:
        return f"{a}.25", f"{a}\\frac{{1}}{{4}}", f"{a}.5"
    if kind == 3:
        return f"{a}\\sqrt{{{b}}}", f"\\sqrt{{{a * a * b}}}", f"{a + 1}\\sqrt{{{b}}}"
    if kind == 4:
        return f"x^2+{a}x+{b}", f"{b}+{a}x+x^2", f"x^2+{b}x+{a + 1}"
    if kind == 5:
        return f"({-a}, {b}]", f"({-a},{b}]", f"[{-a}, {b}]"
    if kind == 6:
        return f"{a}, {b + 41}", f"{b + 41}, {a}", f"{a}, {b + 42}"
    return f"\\frac{{{a}\\pi}}{{{b}}}", f"\\frac{{{a}}}{{{b}}}\\pi", f"\\frac{{{a + 1}\\pi}}{{{b}}}"

def reasoning(rng: random.Random):
    lines = []
    for _ in range(rng.randint(4, 12)):
        p, q = rng.randint(1, 30), rng.randint(1, 30)
        lines.append(rng.choice([
            f"First, note that $x^2 + {p}x = {q}$, so completing the square gives $(x + \\frac{{{p}}}{{2}})^2 = {q} + \\frac{{{p * p}}}{{4}}$.",
            f"The area of the triangle is $\\frac{{1}}{{2}} \\cdot {p} \\cdot {q} = {p * q / 2}$ square units.",
            f"Since ${p} \\equiv {p % 7} \\pmod 7$, we check the remaining {q} cases one at a time.",
            f"Multiplying both sides by {p} we get {p * q} = {p}y, hence y = {q}.",
        ]))
    return " ".join(lines)

def make_samples(seed: int) -> list[tuple[str, str, bool]]:
    """200 (ground truth, response, whether the response's answer is right), half of each."""
    rng = random.Random(seed)
    samples = []
    for index in range(200):
        truth, same, wrong = answer_pair(rng)
        answer = same if index % 2 == 0 else wrong
        samples.append((truth, f"{reasoning(rng)}\n\nTherefore, the final answer is $\\boxed{{{answer}}}$.", index % 2 == 0))
    return samples


def timed(score, samples):
    seconds, correct = [], 0
    for truth, response, expected in samples:
        started = time.perf_counter()
        result = score("MATH", response, truth)
        seconds.append(time.perf_counter() - started)
        correct += result["acc"] == expected
    return statistics.median(seconds), max(seconds), correct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seed", nargs="?", type=int, default=0, help="seed of the generated samples (default 0)")
    parser.add_argument("--misses", action="store_true", help="print the samples math_verify gets wrong")
    args = parser.parse_args()
    samples = make_samples(args.seed)
    math_verify_scorer.score("MATH", "\\boxed{1}", "1")  # imports and first-use set-up outside the timing
    for name, score in [("math", hendrycks_math.score), ("math_verify", math_verify_scorer.score)]:
        median, worst, agree = timed(score, samples)
        print(f"{name:12} median {median * 1e3:8.3f} ms  max {worst * 1e3:8.1f} ms  right on {agree}/200 (100 equivalent forms, 100 wrong)")
    if args.misses:
        for truth, response, expected in samples:
            result = math_verify_scorer.score("MATH", response, truth)
            if result["acc"] != expected:
                print("MISS", truth, "|", response[-40:], result, expected)


if __name__ == "__main__":
    main()
