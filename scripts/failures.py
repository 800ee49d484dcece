#!/usr/bin/env python3
"""Prints, last and short, why each failed test failed: CI keeps the head and the tail of the
suite's output, so this summary is what a reader of a failed run sees.

Usage: failures.py JUNIT_XML [SCENARIOS_LOG]
  JUNIT_XML      nextest's JUnit report (.config/nextest.toml writes target/nextest/default/junit.xml)
  SCENARIOS_LOG  decode-node's scenario output (lines "test NAME ... FAILED: why")
"""
import sys
import xml.etree.ElementTree as ET

LINES_PER_TEST = 12


def why(text: str) -> list[str]:
    """The panic line and what follows it (the assertion's message), without the backtrace."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "panicked at" in line:
            out = []
            for l in lines[i : i + LINES_PER_TEST]:
                if l.strip().startswith(("stack backtrace:", "note: run with")):
                    break
                out.append(l[:900])
            return out
    return [l[:900] for l in lines[-LINES_PER_TEST:]]


def main() -> int:
    failed = 0
    print("=== failed tests: why (summary) ===")
    try:
        cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
    except (OSError, ET.ParseError) as e:
        print(f"(no nextest report: {e})")
        cases = []
    for case in cases:
        bad = next(iter(case.findall("failure") + case.findall("error")), None)
        if bad is None:
            continue
        failed += 1
        print(f"--- {case.get('classname')} {case.get('name')} ({case.get('time')} s)")
        text = "\n".join(
            filter(None, [(case.findtext("system-err") or ""), (case.findtext("system-out") or ""), bad.text or ""])
        )
        for line in why(text):
            print(f"    {line}")
        flaky = case.findall("flakyFailure") + case.findall("rerunFailure")
        if flaky:
            print(f"    ({len(flaky)} earlier attempt(s) failed too)")
    if len(sys.argv) > 2:
        try:
            for line in open(sys.argv[2], errors="replace"):
                if " ... FAILED" in line:
                    failed += 1
                    print(f"--- decode-node scenario: {line.strip()[:800]}")
        except OSError as e:
            print(f"(no scenario log: {e})")
    print(f"=== {failed} failed ===")
    return 0


if __name__ == "__main__":
    sys.exit(main())
