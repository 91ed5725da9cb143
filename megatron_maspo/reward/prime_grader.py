"""A second grader following the rules of the paper's evaluation grader (verl's ``prime_math``).

MASPO trains with Math-Verify (App. C.2) but evaluates with verl's ``prime_math`` scorer (§5.1), a
PRM800K-style checker. This module is our own implementation of its published rules, so evaluation
numbers can be reported under either grader (``maspo eval --grader prime_math``); it is not a copy and
small differences from verl's code may remain. ``scripts/grader_disagreements.py`` prints cases where
the two graders disagree (docs/rewards.md).

Extraction (``extract_answer``), applied in order to the response:

1. after the last ``answer:`` / ``answer is`` / ``answers are`` (case-insensitive), each in turn;
   before the last ``is the answer`` / ``is answer`` / ``are the answers`` / ``are answers``;
2. the content of the last ``\\boxed{}``, if any;
3. the text before the last ``". "``;
4. after the last of ``be ``, ``is ``, ``are ``, ``=``, ``: ``, ``get ``;
5. "matched" only if the result contains a digit (graded either way).

Equivalence (``answers_match``), correct if any holds:

a. equal after a MATH-style normalisation (spaces, ``\\left``/``\\right``, ``\\dfrac``→``\\frac``,
   ``^\\circ``, ``\\%``, ``$``, a ``\\text{}`` unit suffix, ``0.5``→``.5`` style leading zeros);
b. equal after a second normalisation (``\\text{}`` unwrapped, unit words and ``million``/``billion``
   dropped, ``or``/``and`` → ``,``, integer-valued floats → integers, LaTeX → plain, lower case);
c. element by element for tuples / intervals (brackets must agree): two plain fractions must be
   identical (an unreduced fraction is wrong); an integer gold needs an integer answer; otherwise
   SymPy must simplify the difference to 0 (skipped for > 2 unknown letters or ``^{`` / ``^(``);
d. numerically within a relative 1e-4 (with ``\\pi`` read as π or as 3.14).

Everything the rules cannot parse is simply "not equal"; the pool's deadline bounds SymPy.
"""

from __future__ import annotations

import math
import re

from megatron_maspo.reward.base import GradeStatus
from megatron_maspo.reward.extract import last_boxed

_AFTER = ("answer:", "answer is", "answers are")
_BEFORE = ("is answer", "is the answer", "are answers", "are the answers")
_TAIL = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week",
          "month", "year", "foot", "feet", "inch", "yard", "liter")
_FRAC = re.compile(r"^-?[0-9]+\.?/0*[1-9][0-9]*\.?$")


def extract_answer(response: str, max_chars: int = 1024) -> tuple[bool, str]:
    """``(matched, candidate)`` per the extraction rules of the module docstring."""
    text, matched = response, False
    for marker in _AFTER:
        i = text.lower().rfind(marker)
        if i >= 0:
            matched, text = True, text[i + len(marker):].strip()
    for marker in _BEFORE:
        i = text.lower().rfind(marker)
        if i >= 0:
            matched, text = True, text[:i].strip()
    boxed = last_boxed(text, max_chars)
    if boxed:
        matched, text = True, boxed
    if ". " in text:
        text = text[: text.rfind(". ")].strip()
    for marker in _TAIL:
        i = text.lower().rfind(marker)
        if i >= 0:
            matched, text = True, text[i + len(marker):].strip()
    return matched and any(c.isdigit() for c in text), text


def _braced(s: str, start: int) -> tuple[str, int] | None:
    """Content of the ``{...}`` group opening at ``s[start]`` and the index after it."""
    if start >= len(s) or s[start] != "{":
        return None
    depth = 0
    for j in range(start, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[start + 1: j], j + 1
    return None


def _latex_to_plain(s: str) -> str:
    """A small LaTeX → SymPy-readable converter (fractions, roots, π, products, braces)."""
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(20):  # nested \frac / \sqrt, innermost last
        i = max(s.rfind("\\frac"), s.rfind("\\sqrt"))
        if i < 0:
            break
        if s.startswith("\\frac", i):
            a = _braced(s, i + 5)
            b = _braced(s, a[1]) if a else None
            if not (a and b):
                break
            s = f"{s[:i]}(({a[0]})/({b[0]})){s[b[1]:]}"
        else:
            a = _braced(s, i + 5)
            if not a:
                break
            s = f"{s[:i]}sqrt({a[0]}){s[a[1]:]}"
    for tex, plain in (("\\pi", "pi"), ("\\cdot", "*"), ("\\times", "*"), ("\\infty", "oo"),
                       ("\\left", ""), ("\\right", ""), ("\\,", ""), ("\\!", ""), ("{", "("), ("}", ")")):
        s = s.replace(tex, plain)
    return s.replace("\\", "").strip()


def normalize_math(s: str) -> str:
    """Rule (a): MATH-style string normalisation."""
    s = s.strip().replace("\n", "").rstrip(".")
    s = s.replace("\\!", "").replace("\\\\", "\\").replace("tfrac", "frac").replace("dfrac", "frac")
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)  # \frac12 → \frac{1}{2}
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = re.sub(r"\\text\{\s*[a-zA-Z ]+\}$", "", s).strip()
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    s = s.replace(" ", "")
    if re.fullmatch(r"-?\d+/\d+", s):  # a/b → \frac{a}{b}
        num, den = s.split("/")
        s = f"\\frac{{{num}}}{{{den}}}"
    return s


def normalize_plain(s: str) -> str:
    """Rule (b): the second normalisation (to plain text, lower case)."""
    m = re.fullmatch(r"\\text\{(.+?)\}", s.strip())
    s = m.group(1) if m else s
    s = s.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    s = s.replace(" or ", " , ").replace(" and ", " , ")
    for word, power in (("million", 6), ("billion", 9), ("trillion", 12)):
        s = s.replace(word, f"*10^{power}")
    for unit in _UNITS:
        s = re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", s)
    s = re.sub(r"\^ *\\circ", "", s).strip()
    if len(s) > 1 and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    s = re.sub(r",\\! *", "", s)
    if _is_number(s) and _is_integer(float(s)):
        s = str(int(round(float(s))))
    if "\\" in s:
        s = _latex_to_plain(s)
    s = re.sub(r"- *", "-", s)
    s = re.sub(r"([0-9]) +([0-9])", r"\1+\2", s)  # mixed numbers: 7 3/4 → 7+3/4
    s = s.lower().strip()
    if _is_number(s.replace(",", "")) and _is_integer(float(s.replace(",", ""))):
        s = str(int(float(s.replace(",", ""))))
    return s


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def _is_integer(x: float) -> bool:
    return math.isfinite(x) and abs(x - round(x)) <= 1e-7


def _str_is_int(s: str) -> bool:
    s = re.sub(r"(\d),(\d\d\d)($|\D)", r"\1\2\3", s)
    return _is_number(s) and _is_integer(float(s))


def _split_tuple(s: str) -> list[str]:
    s = re.sub(r"(\d),(\d\d\d)($|\D)", r"\1\2\3", s)
    if len(s) > 2 and s[0] in "([" and s[-1] in ")]" and not any(c in s[1:-1] for c in "()[]"):
        return [e.strip() for e in s[1:-1].split(",")]
    return [s] if s else []


def _sympy_equal(a: str, b: str) -> bool:
    expr = f"({a})-({b})"
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "").replace("pi", "") if c.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr or re.search(r"\^[0-9]+\^|\^[0-9][0-9]+", expr):
        return False
    try:
        import sympy
        from sympy.parsing import sympy_parser

        tr = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
        return sympy.simplify(sympy_parser.parse_expr(expr.replace("^", "**"), transformations=tr)) == 0
    except Exception:  # noqa: BLE001 - anything unparsable is "not equal"
        return False


def _numeric(s: str, pi: float) -> float | None:
    """The value of ``s`` as a float, with π read as ``pi``; None if it is not a plain number."""
    t = _latex_to_plain(s).replace(",", "").replace("%", "").replace("$", "").strip()
    try:
        import sympy
        from sympy.parsing import sympy_parser

        tr = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
        v = float(sympy_parser.parse_expr(t.replace("^", "**"), transformations=tr).subs(sympy.pi, pi))
        return v if math.isfinite(v) else None
    except Exception:  # noqa: BLE001 - not a number
        return None


def answers_match(given: str, gold: str) -> bool:
    """Rules (a)-(d) of the module docstring."""
    if not given:
        return False
    if normalize_math(given) == normalize_math(gold):
        return True
    g, a = normalize_plain(gold), normalize_plain(given)
    if g == a:
        return True
    if a:
        ge, ae = _split_tuple(g), _split_tuple(a)
        ok = len(ge) == len(ae) and not (len(ge) > 1 and (g[0] != a[0] or g[-1] != a[-1]))
        if ok:
            for x, y in zip(ge, ae):
                if _FRAC.match(x) and _FRAC.match(y):
                    ok = x == y
                elif _str_is_int(x) != _str_is_int(y):
                    ok = False
                else:
                    ok = _sympy_equal(x, y)
                if not ok:
                    break
            if ok:
                return True
    for pi in ((math.pi, 3.14) if "\\pi" in given + gold else (math.pi,)):
        x, y = _numeric(given, pi), _numeric(gold, pi)
        if x is not None and y is not None and math.isclose(x, y, rel_tol=1e-4, abs_tol=1e-12):
            return True
    return False


def grade_prime(response: str, gold: str, policy: str, max_chars: int, timeout_s: float) -> GradeStatus:
    """``MathReward``-compatible grade function (``policy`` and ``timeout_s`` unused: the pool's
    deadline bounds the work)."""
    matched, candidate = extract_answer(response, max_chars)
    if answers_match(candidate, gold):
        return GradeStatus.CORRECT
    return GradeStatus.WRONG if matched else GradeStatus.NO_ANSWER


def prime_math_reward(config):  # noqa: ANN001, ANN201 - RewardConfig -> MathReward
    """A ``RewardFn`` grading with these rules on the same crash- and hang-proof worker pool."""
    from megatron_maspo.reward.math_reward import MathReward

    return MathReward(config, grade_fn=grade_prime)
