#!/usr/bin/env bash
# The engine's plan phase (the step event's plan_ms) over the 16-sequence,
# 16-token decode steps of a 16-client load-example run: median, p10 and
# p90 per run. Drafters come as arguments (none: the plain engine), e.g.
#   bash bench/spec/plan_phase.sh --mtp early-exit:8 --prompt-lookup
# BIN (the load example, release build), RUNS (3), MODEL (SmolLM2's GGUF).
set -uo pipefail
BIN=${BIN:-target/release/examples/multi_client_load}
MODEL=${MODEL:-../shared/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf}
for run in $(seq 1 "${RUNS:-3}"); do
  RUST_LOG=tandem::engine::executor=debug timeout 300 "$BIN" --model "$MODEL" \
    --show-answers 0 --max-tokens 48 --dtype q8_0 --prompts bench/spec/chat_prompts.txt \
    --clients 16 --max-seqs 16 "$@" 2>&1 | python3 -c '
import re, statistics, sys
plans = []
for line in sys.stdin:
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)  # tracing colours its output
    if "plan_ms" not in line:
        continue
    f = dict(re.findall(r"(\w+)=(\S+)", line))
    if f["seqs"] == "16" and f["tokens"] == "16":
        plans.append(float(f["plan_ms"]) * 1000)
plans.sort()
print(f"run '"$run"': {len(plans)} 16x16 steps; plan us median {statistics.median(plans):.1f}"
      f" p10 {plans[len(plans) // 10]:.1f} p90 {plans[9 * len(plans) // 10]:.1f}")
'
done
