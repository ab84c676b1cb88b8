"""Counts of a run.sh output directory, plain vs injected, and every test that passes plain
but not injected, with the injected run's message.

    python3 bench/ds_unit_tests/compare.py OUT
"""
import collections
import glob
import os
import sys
import xml.etree.ElementTree as ET


def results(directory: str) -> dict:
    res = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.xml"))):
        for case in ET.parse(path).getroot().iter("testcase"):
            key = f"{case.get('classname')}::{case.get('name')}"
            status, msg = "passed", ""
            for tag, name in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
                e = case.find(tag)
                if e is not None:
                    status, msg = name, (e.get("message") or "").replace("\n", " ")
                    break
            res[key] = (status, msg)
    return res


def main(out: str) -> None:
    for ranks in (1, 2):
        plain, injected = (results(os.path.join(out, f"{m}-{ranks}")) for m in ("plain", "injected"))
        if not plain and not injected:
            continue
        print(f"== {ranks} rank(s): {len(set(plain) | set(injected))} test ids")
        for name, res in (("plain", plain), ("injected", injected)):
            print(f"  {name:9s}", dict(sorted(collections.Counter(s for s, _ in res.values()).items())))
        moves = collections.Counter((plain.get(k, ("missing",))[0], injected.get(k, ("missing",))[0])
                                    for k in set(plain) | set(injected))
        print("  plain -> injected:", dict(sorted(moves.items())))
        for k in sorted(set(plain) | set(injected)):
            if plain.get(k, ("missing",))[0] == "passed" and injected.get(k, ("missing",))[0] != "passed":
                status, msg = injected.get(k, ("missing (the file's run ended early: see its log)", ""))
                print(f"  PASS -> {status}: {k}\n      {msg[:300]}")


if __name__ == "__main__":
    main(sys.argv[1])
