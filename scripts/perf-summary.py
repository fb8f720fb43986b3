#!/usr/bin/env python3
"""Sum a `perf record` profile's samples by who spent them.

    perf record -F 2000 -g -o prof.data <bench> --bench <group> --profile-time 6
    ./scripts/perf-summary.py prof.data [TOP]

Prints the flat (self) share of each bucket — the kernel, Fief's own code,
wasmtime and cranelift's runtime, guest code (JIT frames perf cannot name),
tokio, the allocator and copies, hyper/axum, the rest — then the TOP
hottest symbols (20 by default). docs/benchmarks.md's profile summaries are
this script's output.
"""
import collections
import re
import subprocess
import sys

BUCKETS = [
    ("kernel", lambda s, k: k),
    ("guest code (JIT, unnamed)", lambda s, k: re.fullmatch(r"0x[0-9a-f]+", s) is not None),
    ("allocator and copies (libc)", lambda s, k: re.search(
        r"malloc|free|realloc|memmove|memcpy|memset|memcmp|_int_|cfree|consolidate|unlink_chunk|memalign", s) is not None),
    ("Fief (fief, fief_core)", lambda s, k: re.match(r"(<)?fief(_core)?::", s) is not None
        or "fief::" in s.split(" as ")[0]),
    ("compiling (cranelift, regalloc2: set-up)", lambda s, k: "regalloc2" in s or "cranelift" in s),
    ("wasmtime runtime", lambda s, k: "wasmtime" in s),
    ("tokio", lambda s, k: "tokio" in s),
    ("hyper / axum / http", lambda s, k: re.search(r"hyper|axum|http|h2::|tower", s) is not None),
    ("metrics (prometheus-client)", lambda s, k: "prometheus" in s),
    ("clock reads", lambda s, k: "clock_gettime" in s or "read_tsc" in s),
    ("serialization (postcard, serde)", lambda s, k: "postcard" in s or "serde" in s),
]


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    out = subprocess.run(
        ["perf", "report", "-i", path, "--no-children", "--sort", "symbol",
         "--stdio", "-g", "none", "--percent-limit", "0"],
        capture_output=True, text=True, check=True).stdout
    totals = collections.Counter()
    rows = []
    for line in out.splitlines():
        m = re.match(r"\s+([0-9.]+)%\s+\[(.)\]\s+(.*?)\s*$", line)
        if not m:
            continue
        share, kind = float(m.group(1)), m.group(2)
        # perf pads the symbol and may append empty columns ("-  -").
        sym = re.sub(r"(\s+-)+$", "", m.group(3)).strip()
        rows.append((share, kind, sym))
        kernel = kind == "k"
        for name, test in BUCKETS:
            if test(sym, kernel):
                totals[name] += share
                break
        else:
            totals["other"] += share
    print("| who | share of samples |")
    print("|---|---|")
    for name, share in totals.most_common():
        print(f"| {name} | {share:.1f} % |")
    print()
    print(f"hottest {top}:")
    for share, kind, sym in rows[:top]:
        print(f"  {share:5.2f}%  [{kind}] {sym[:110]}")


if __name__ == "__main__":
    main()
