"""Golden scores of verl's rule rewards beyond GSM8K and MATH, computed by verl's own
`verl.utils.reward_score.default_compute_score`.

    python scripts/make_reward_rule_goldens.py [OUT.json]    # default tests/data/verl-<version>-reward-rules.json

Needs verl importable with its dependencies, and mathruler (verl's `verl-core` extra; its
geometry3k rule imports it): `pip install verl==0.9.1 mathruler` in a venv of its own (the same
with verl==0.8.0 makes the v0.8.0 file). Nothing of miniverl is imported: the file is verl's
answer. `python -m miniverl.conformance OUT.json` checks miniverl's rules against either file:
v0.8.0 scores 3 of the DAPO strings otherwise (it has no \boxed{} fallback), so the v0.8.0 file is
checked with 0.8.0's DAPO rule (miniverl's `boxed_fallback=False`).

Cases (`reward_score`, as in verl-0.8.0-task-rewards.json): shared strings for DAPO's math rule
(math_dapo, math, math_dapo_reasoning, aime*), PRIME's (numina_*), Geometry3K's, Search-R1's
exact match (searchR1_*), and a few MATH strings where the normalisation fails part-way. A
result that is a dict (math_dapo's) is recorded by its "score".
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import verl
from verl.utils.reward_score import default_compute_score

SEED = 20261215
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / f"verl-{verl.__version__}-reward-rules.json"
LONG = "Let us reason step by step. " * 40  # ~1,100 characters: past every rule's tail window
PMATRIX_12 = "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"

SOLUTIONS = (
    # ---- DAPO (math_dapo.py): Minerva `Answer:` lines, then (0.9.x) the last \boxed{}; +1 / -1
    ("math_dapo", "Let me think.\nAnswer: 42", "42"),
    ("math_dapo", "answer : $\\frac{1}{2}$", "\\frac12"),
    ("math", "ANSWER: 1,000 dollars", "1000"),
    ("math_dapo_reasoning", "So we solve it.\nAnswer: x = 7", "7"),
    ("math_dapo", "Answer: 5\nOn second thought,\nAnswer: 6", "6"),
    ("math_dapo", "Answer: 5\nOn second thought,\nAnswer: 6", "5"),
    ("math_dapo", "I have no idea.", "3"),
    ("math_dapo", "Answer: 3\n" + LONG, "3"),
    ("math_dapo", LONG + "\nAnswer: 3", "3"),
    ("math_dapo", "Answer: \\text{(B)}", "B"),
    ("math_dapo", "Answer: 90^\\circ", "90"),
    ("math_dapo", "Answer: \\sqrt3", "\\sqrt{3}"),
    ("math_dapo", "Answer: \\boxed{12} square units", "12"),
    ("math_dapo", "Answer: ５", "5"),
    ("aime24", "I think the result is \\boxed{204}.", "204"),
    ("aime2025", "so \\boxed{ 204 }", "204"),
    ("aime", "Answer: 073", "73"),
    ("math", "\\boxed{5}", "5"),
    ("math", "so \\boxed{\\frac{1}{2}}", "0.5"),
    ("math_dapo", "\\boxed{7} " + LONG, "7"),
    ("math_dapo", "Answer: [INVALID]\nbut then \\boxed{7}", "7"),
    # ---- PRIME (prime_math): answer matcher + PRM800K grader + math_equal; 1 / 0
    ("numina_olympiads", "Step 1: ... Step 2: so \\boxed{\\frac{1}{2}}", "0.5"),
    ("numina_cn_k12", "The answer is 12.", "12"),
    ("numina_aops_forum", "Both roots work, answer: (3, -3)", "(3,-3)"),
    ("numina_aops_forum", "Both roots work, answer: (3, -3)", "[3,-3]"),
    ("numina_synthetic_math", "The final answer is $\\boxed{2\\pi}$", "6.2832"),
    ("numina_amc_aime", "so the answer is \\boxed{25\\%}", "0.25"),
    ("numina_synthetic_amc", "$\\textbf{(C)}\\ 12$ is the answer", "C"),
    ("numina_cn_k12", "no digits here", "5"),
    ("numina_olympiads", "The answer is \\boxed{10_2}", "2"),
    ("numina_olympiads", "answer: 1,000,000", "1000000"),
    ("numina_olympiads", "answer: x^2+2x+1", "(x+1)^2"),
    ("numina_olympiads", "answer: \\frac{2}{4}", "\\frac{1}{2}"),
    ("numina_olympiads", "answer: [1, 2)", "[1,2)"),
    ("numina_olympiads", "answer: Interval.Ropen(1, 2)", "[1, 2)"),
    ("numina_olympiads", "answer: [[1], [2]]", PMATRIX_12),
    ("numina_olympiads", "answer: Matrix([[1], [2]])", PMATRIX_12),
    ("numina_olympiads", "answer: Point(1, 2)", "(1, 2)"),
    ("numina_olympiads", "答案 answer: ½", "\\frac{1}{2}"),
    ("numina_olympiads", LONG + " answer: 7", "7"),
    ("numina_olympiads", "answer: 3.14159", "\\pi"),
    ("numina_olympiads", "We get 2 + 3 = 5", 5),  # an integer ground truth: verl compares its str()
    ("numina_olympiads", "the answer is \\boxed{3}", "4"),
    # ---- Geometry3K (geo3k.py): 0.9 x mathruler's grader on the last \boxed{} + 0.1 x format
    ("hiyouga/geometry3k", "<think>angles sum to 180</think> The answer is \\boxed{30}", "30"),
    ("hiyouga/geometry3k", "The answer is \\boxed{30}", "30"),
    ("hiyouga/geometry3k", "<think>x</think>\\boxed{31}", "30"),
    ("hiyouga/geometry3k", "<think>x</think> 30", "30"),
    ("hiyouga/geometry3k", "<think>.</think> \\boxed{2\\sqrt{3}}", "2 \\sqrt{3}"),
    ("hiyouga/geometry3k", "\\boxed{\\frac{\\sqrt{3}}{2}}", "0.866"),
    ("hiyouga/geometry3k", "\\boxed{50\\%}", "50"),
    ("hiyouga/geometry3k", "\\boxed{12 cm}", "12"),
    ("hiyouga/geometry3k", "<think>\nmulti\nline</think>\n\\boxed{x+1}", "1+x"),
    ("hiyouga/geometry3k", "<think>x</think>\\boxed{5", "5"),
    ("hiyouga/geometry3k", "<think>x</think>\\boxed{√3}", "\\sqrt{3}"),
    ("hiyouga/geometry3k", "<think>x</think>\\boxed{\\frac{1}{2}}", "0.5"),
    # ---- Search-R1 (search_r1_like_qa_em.py): exact match of the last <answer>; 1 / 0.25 / 0
    ("searchR1_nq", "<answer>The Eiffel Tower</answer>", {"target": ["Eiffel Tower"]}),
    ("searchR1_triviaqa", "<answer>paris</answer> then <answer>London!</answer>", {"target": ["london"]}),
    ("searchR1_popqa", "I could not find it.", {"target": ["Paris"]}),
    ("searchR1_hotpotqa", "<answer>\n  Barack   Obama \n</answer>", {"target": ["barack obama", "obama"]}),
    ("searchR1_2wikimultihopqa", "<answer>Rome</answer>", {"target": ["Paris", "Lyon"]}),
    ("searchR1_musique", "<answer>x</answer>" * 11 + "<answer>Paris</answer>", {"target": ["Paris"]}),
    ("searchR1_bamboogle", "<answer>an apple</answer>", {"target": "Apple"}),
    ("searchR1_nq", "<answer>Café</answer>", {"target": ["cafe"]}),
    # ---- MATH (math_reward.py): a trailing \sqrt or \frac stops the normalisation; verbatim comparison
    ("lighteval/MATH", "\\boxed{2\\sqrt }", "2\\sqrt"),
    ("lighteval/MATH", "\\boxed{\\frac }", "\\frac"),
)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    random.seed(SEED)  # search_r1_like_qa_em prints one sample in 64, drawn from the global random
    cases = []
    for source, solution, truth in SOLUTIONS:
        result = default_compute_score(source, solution, truth)
        score = result["score"] if isinstance(result, dict) else result
        cases.append(
            {
                "kind": "reward_score",
                "data_source": source,
                "solution_str": solution,
                "ground_truth": truth,
                "expected": {"score": float(score)},
            }
        )
    golden = {
        "source": f"verl v{verl.__version__}: utils/reward_score.default_compute_score (math_dapo, prime_math, "
        "geo3k with mathruler, search_r1_like_qa_em, math_reward)",
        "verl_version": verl.__version__,
        "made_by": "scripts/make_reward_rule_goldens.py",
        "dtype": "float64",
        "seed": SEED,
        "cases": cases,
    }
    out.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
