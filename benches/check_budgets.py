#!/usr/bin/env python3
"""Compares iai-callgrind instruction counts with the committed budgets.

usage: check_budgets.py BUDGETS.toml ICOUNT_OUTPUT.txt [--tolerance 0.02]

Every budgeted case must appear in the output, and its instruction count
must not exceed the budget by more than the tolerance (default 2%). Cases in
the output without a budget are listed so they can be added. Exits 1 on any
failure.
"""
import re
import sys
import tomllib


def parse(text):
    counts, name = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace() and "::" in line:
            # The whole header line: `module::group::function id:setup(args)`.
            # Only the first word would merge every argument of a function.
            name = line.strip()
        m = re.match(r"\s+Instructions:\s+(\d+)", line)
        if m and name:
            counts[name] = int(m.group(1))
            name = None
    return counts


def main(argv):
    tol = 0.02
    if "--tolerance" in argv:
        i = argv.index("--tolerance")
        tol = float(argv[i + 1])
        del argv[i : i + 2]
    with open(argv[1], "rb") as f:
        budgets = tomllib.load(f)["budget"]
    with open(argv[2]) as f:
        counts = parse(f.read())
    if not counts:
        print("no instruction counts found in the bench output")
        return 1
    failed = 0
    for case, budget in sorted(budgets.items()):
        got = counts.get(case)
        if got is None:
            print(f"MISSING  {case}: budget {budget}, not in the output")
            failed += 1
        elif got > budget * (1 + tol):
            print(f"OVER     {case}: {got} > budget {budget} (+{100 * (got / budget - 1):.1f}%)")
            failed += 1
        else:
            print(f"ok       {case}: {got} <= {budget}")
    for case in sorted(set(counts) - set(budgets)):
        print(f"UNBUDGETED {case}: {counts[case]}")
    print(f"{len(budgets) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
