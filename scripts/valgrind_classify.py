"""Reads a valgrind memcheck log of the embedded-Python smoke run and counts the memory errors and
definite leaks whose stacks pass through dlbridge's own code: a frame in a Rust function of the
dlbridge crate, or in dlbridge's extension module itself. A path that merely contains the word
(a checkout named `dlbridge` puts it in every numpy and CPython frame of its .venv) does not count.

    python3 scripts/valgrind_classify.py LOG      exits 1 if any such report exists
    python3 scripts/valgrind_classify.py --self-test
"""

from __future__ import annotations

import re
import sys

# "by 0x4A2B: dlbridge::python::protocols::from_buffer (protocols.rs:123)" or
# "by 0x4A2B: <dlbridge::managed::ManagedTensor as core::ops::drop::Drop>::drop (...)" or a
# frame inside the extension: "(in /any/path/_dlbridge.cpython-311-x86_64-linux-gnu.so)".
FRAME = re.compile(r"(?:at|by) 0x[0-9A-Fa-f]+: (?:<)?dlbridge(?:_scale)?::")
OBJECT = re.compile(r"\(in [^()]*/(?:_dlbridge|dlbridge_scale)\.[^/()]*\.so\)")


def ours(block: str) -> bool:
    return any(FRAME.search(line) or OBJECT.search(line) for line in block.splitlines())


def classify(text: str) -> tuple[list[str], list[str], list[str], list[str]]:
    blocks = re.split(r"\n==\d+== \n", text)
    errors = [b for b in blocks if re.search(r"Invalid (read|write|free)|uninitialised|Mismatched free", b)]
    leaks = [b for b in blocks if "definitely lost" in b and "loss record" in b]
    return errors, leaks, [b for b in errors if ours(b)], [b for b in leaks if ours(b)]


def self_test() -> None:
    venv = "/work/dlbridge/.venv/lib/python3.11/site-packages"
    theirs = (
        "==1== 32 bytes in 1 blocks are definitely lost in loss record 5 of 90\n"
        "==1==    at 0x483877F: malloc (vg_replace_malloc.c:307)\n"
        f"==1==    by 0x5A1B2C3: PyArray_NewFromDescr (in {venv}/numpy/_core/_multiarray_umath.so)\n"
    )
    mine = (
        "==1== 64 bytes in 1 blocks are definitely lost in loss record 6 of 90\n"
        "==1==    at 0x483877F: malloc (vg_replace_malloc.c:307)\n"
        "==1==    by 0x6B1C2D3: dlbridge::export::new_exported (export.rs:270)\n"
    )
    inside = (
        "==1== Invalid read of size 8\n"
        f"==1==    at 0x6B1C2D3: ??? (in {venv}/dlbridge/_dlbridge.cpython-311-x86_64-linux-gnu.so)\n"
    )
    text = "\n==1== \n".join([theirs, mine, inside])
    errors, leaks, our_errors, our_leaks = classify(text)
    assert (len(errors), len(leaks), len(our_errors), len(our_leaks)) == (1, 2, 1, 1), classify(text)
    assert not ours(theirs), "a numpy frame under a checkout named dlbridge was counted as dlbridge's"
    print("valgrind_classify: self-test passed")


def main() -> int:
    if sys.argv[1:] == ["--self-test"]:
        self_test()
        return 0
    text = open(sys.argv[1]).read()
    errors, leaks, our_errors, our_leaks = classify(text)
    summary = re.findall(r"ERROR SUMMARY: (\d+) errors", text)
    print(
        f"valgrind python: {len(our_errors)} memory errors and {len(our_leaks)} definite leaks through dlbridge "
        f"({len(errors)} errors, {len(leaks)} definite-leak records in the whole process; "
        f"ERROR SUMMARY {summary[-1] if summary else '?'})"
    )
    for b in (our_errors + our_leaks)[:5]:
        print(b[:3000])
    return 1 if our_errors or our_leaks else 0


if __name__ == "__main__":
    sys.exit(main())
