"""llama.cpp's next-token log-probabilities, teacher-forced over the SmolLM2
references: for each reference prompt and each of its first POSITIONS
greedy ids, the top-2 (id, logprob) of the token after prompt + ids[:i],
from `llama-server /completion` (n_predict 1, n_probs 2, raw logits).

    python3 bench/llama_cpp/teacher_forced.py MODEL.gguf OUT.json [PORT]

Writes {"model": …, "positions": {prompt name: [[id1, lp1, id2, lp2], …]}}.
The test `gguf_quantised_logprobs_are_no_worse_than_llama_cpp` compares
Tandem's quantised paths with these files (bench/llama_cpp/*.json).
"""
import json, subprocess, sys, time, urllib.request

POSITIONS = 16
REF = "../shared/models/smollm2-135m-instruct/reference.json"
model, out = sys.argv[1], sys.argv[2]
port = int(sys.argv[3]) if len(sys.argv) > 3 else 8191
server = subprocess.Popen(
    ["/work/llama.cpp/bin/llama-server", "-m", model, "--port", str(port), "-t", "2",
     "-c", "2048", "--no-warmup"],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

def post(path, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=60))

try:
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except Exception:
            time.sleep(0.2)
    refs = json.load(open(REF))["prompts"]
    result = {"model": model.rsplit("/", 1)[-1], "positions": {}}
    for p in refs:
        rows = []
        for i in range(min(POSITIONS, len(p["generated_ids"]))):
            ids = p["prompt_ids"] + p["generated_ids"][:i]
            r = post("/completion", {"prompt": ids, "n_predict": 1, "n_probs": 2,
                                     "temperature": 0, "cache_prompt": False,
                                     "post_sampling_probs": False})
            top = r["completion_probabilities"][0]["top_logprobs"]
            rows.append([top[0]["id"], top[0]["logprob"], top[1]["id"], top[1]["logprob"]])
        result["positions"][p["name"]] = rows
    json.dump(result, open(out, "w"), indent=1)
finally:
    server.terminate()
