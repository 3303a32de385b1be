#!/usr/bin/env python3
"""Summarises the engine's per-pass debug trace (`RUST_LOG=
tandem::engine::executor=debug,tandem::engine::policy=debug`) of a
multi_client_load run: per run (the "--- MTP ..." headers), decode passes by
kind (plain or verifying; captured a CUDA graph or not) with their count,
median and mean time, and the policy's plans that granted drafts, with the
pass and verify times they were priced at.

    multi_client_load ... 2>&1 | python3 bench/spec/pass_trace.py
"""
import re
import statistics
import sys

FIELD = re.compile(r"(\w+)=(\[[^\]]*\]|\S+)")
# tracing colours its output even into a pipe.
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def fields(line):
    return {k: v for k, v in FIELD.findall(line)}


def report(label, passes, plans, steps, lines):
    if passes or plans:
        print(f"{label}")
        summarise(passes, plans, steps)
    for line in lines:
        print(line)


def summarise(passes, plans, steps):
    if steps:
        total = {k: sum(float(p.get(k, 0)) for p in steps) for k in STEP_PARTS}
        rest = total["total_ms"] - sum(v for k, v in total.items() if k != "total_ms")
        parts = ", ".join(f"{k[:-3]} {v:.1f}" for k, v in total.items())
        print(f"  {len(steps)} steps, ms in all: {parts}, rest {rest:.1f}")
    kinds = {}
    for p in passes:
        kinds.setdefault((p["verifies"], p["captured"]), []).append(p)
    for (verifies, captured), ps in sorted(kinds.items()):
        ms = [float(p["pass_ms"]) for p in ps]
        tokens = statistics.mean(int(p["tokens"]) for p in ps)
        print(
            f"  verifies={verifies:5} captured={captured:5}: {len(ps):5} passes,"
            f" {tokens:6.1f} tokens on average, median {statistics.median(ms):7.3f} ms,"
            f" mean {statistics.mean(ms):7.3f} ms, total {sum(ms):8.1f} ms"
        )
        parts = [k for k in ("plan_ms", "forward_ms", "sample_ms") if k in ps[0]]
        if parts:
            medians = ", ".join(
                f"{k[:-3]} {statistics.median(float(p[k]) for p in ps):.3f}" for k in parts
            )
            print(f"      medians (ms): {medians}")
    granted = [p for p in plans if int(p.get("drafts", "0")) > 0]
    cold = sum(p.get("cold") == "true" for p in plans)
    print(f"  plans: {len(plans)} ({cold} on priors), {len(granted)} granting drafts")
    for p in granted[:: max(1, len(granted) // 6)][:6]:
        print(
            f"    base_tokens={p.get('base_tokens')} cold={p.get('cold')} drafts={p.get('drafts')}"
            f" pass_ms={p.get('pass_ms')} verify_ms={p.get('verify_ms')}"
        )


STEP_PARTS = ("kv_ms", "plan_ms", "draft_ms", "forward_ms", "sample_ms", "total_ms")


def main():
    label, passes, plans, steps, lines = "(before any run)", [], [], [], []
    for line in sys.stdin:
        line = ANSI.sub("", line)
        if line.startswith("--- MTP"):
            report(label, passes, plans, steps, lines)
            label, passes, plans, steps, lines = line.strip(), [], [], [], []
        elif "decode pass" in line and "verifies=" in line:
            passes.append(fields(line))
        elif " step " in line and "total_ms=" in line:
            steps.append(fields(line))
        elif "draft plan" in line:
            # `pass_ms=[..]` lists hold commas but no spaces.
            plans.append(fields(line))
        elif "medians" in line or "on / off" in line or line.startswith("aggregate"):
            lines.append(line.rstrip())
    report(label, passes, plans, steps, lines)


if __name__ == "__main__":
    main()
