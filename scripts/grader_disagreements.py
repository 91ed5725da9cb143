"""Cases where the training grader (Math-Verify) and the paper's evaluation grader rules (prime_math)
disagree: runs both real graders on a fixed list of (response, gold) pairs and prints a Markdown table.

    python scripts/grader_disagreements.py            # only the disagreements
    python scripts/grader_disagreements.py --all      # every case
"""

from __future__ import annotations

import argparse

from megatron_maspo.reward.config import RewardConfig
from megatron_maspo.reward.math_reward import MathReward
from megatron_maspo.reward.prime_grader import prime_math_reward

CASES = [  # (what it probes, response, gold)
    ("boxed fraction", r"so \boxed{\frac{1}{2}}", r"\frac12"),
    ("decimal vs fraction", r"\boxed{0.5}", r"\frac{1}{2}"),
    ("unreduced fraction", r"\boxed{\frac{2}{4}}", r"\frac{1}{2}"),
    ("integer written as float", r"\boxed{12.0}", "12"),
    ("integer as an expression", r"\boxed{24/2}", "12"),
    ("unit word in the box", r"\boxed{5 \text{ cm}}", "5"),
    ("plain unit", r"\boxed{5 cm}", "5"),
    ("degrees", r"\boxed{30^\circ}", "30"),
    ("percent", r"\boxed{25\%}", "25"),
    ("percent vs fraction", r"\boxed{25\%}", "0.25"),
    ("pi approximated", r"\boxed{6.28}", r"2\pi"),
    ("4-digit rounding", r"\boxed{3.1416}", r"\pi"),
    ("equation in the box", r"\boxed{x=3}", "3"),
    ("tuple spacing", r"\boxed{(1, 2)}", "(1,2)"),
    ("interval brackets", r"\boxed{[1, 2)}", "(1,2)"),
    ("set vs list", r"\boxed{1, 2}", r"\{1,2\}"),
    ("'Answer:' line", "Thus\nAnswer: 7", "7"),
    ("'the answer is' sentence", "The answer is 7.", "7"),
    ("no marker, last number", "We get 3 and then 7", "7"),
    ("thousands separator", r"\boxed{1,000}", "1000"),
    ("text answer", r"\boxed{\text{(B)}}", "B"),
    ("sqrt forms", r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt{2}}{2}"),
    ("scientific", r"\boxed{2 \times 10^3}", "2000"),
    ("million", r"\boxed{3 million}", "3000000"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all", action="store_true", help="print every case, not only disagreements")
    args = ap.parse_args()
    responses, golds = [c[1] for c in CASES], [c[2] for c in CASES]
    cfg = RewardConfig(num_workers=1)
    with MathReward(cfg) as mv, prime_math_reward(cfg) as pm:
        a, b = mv(responses, golds).correct, pm(responses, golds).correct
    print("| case | response | gold | math_verify | prime_math |")
    print("|---|---|---|---|---|")
    shown = 0
    for (what, r, g), x, y in zip(CASES, a, b):
        if args.all or x != y:
            shown += 1
            cell = r.replace("\n", " ").replace("|", "\\|")
            print(f"| {what} | `{cell}` | `{g}` | {'✓' if x else '✗'} | {'✓' if y else '✗'} |")
    print(f"\n{shown} of {len(CASES)} cases shown; {sum(x != y for x, y in zip(a, b))} disagree.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
