#!/usr/bin/env python3
"""Replays prompt lookup over the long-edit prompts' greedy answers offline
(BENCHMARKS.md, issue 18, session 56): tokens a step and acceptance at a
fixed draft cap for the engine's rule (the latest earlier occurrence of the
longest matching 1-4-token suffix, `src/engine/ngram.rs`) and for a copy
cursor (after a draft accepted whole, continue from where it was copied,
and search only when the copy breaks).

  tandem serve --model SmolLM2-135M-Instruct.Q4_1.gguf --dtype q8_0 --port 8392 &
  pip install tokenizers
  python3 bench/spec/lookup_cursor_replay.py --url http://localhost:8392 \
      --tokenizer ../shared/models/smollm2-135m-instruct/tokenizer.json
"""
import argparse
import json
import urllib.request

from tokenizers import Tokenizer

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def answers(url, prompts, max_tokens):
    out = []
    for line in open(prompts):
        msg = line.rstrip("\n").replace("\\n", "\n")
        body = {"messages": [{"role": "user", "content": msg}], "max_tokens": max_tokens, "temperature": 0}
        req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        out.append((msg, json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"]))
    return out


def latest_match(h, min_n=1, max_n=4):
    """Start of the continuation of the latest earlier occurrence of the longest suffix."""
    for n in range(min(max_n, len(h) - 1), min_n - 1, -1):
        suffix = h[len(h) - n:]
        for s in range(len(h) - n - 1, -1, -1):
            if h[s:s + n] == suffix:
                return s + n
    return None


def replay(prompt, answer, cap, cursor):
    t = steps = drafted = accepted = unmatched = 0
    src = None
    while t < len(answer):
        h = prompt + answer[:t]
        draft = h[src:src + cap] if cursor and src is not None else []
        if not draft:
            src = latest_match(h)
            draft = h[src:src + cap] if src is not None else []
        k = 0
        while k < len(draft) and t + k < len(answer) and draft[k] == answer[t + k]:
            k += 1
        steps += 1
        drafted += len(draft)
        accepted += k
        unmatched += not draft
        # The copy goes on only if the whole draft and the target's own
        # next token both follow the source.
        full = prompt + answer[:t + k + 1]
        nxt = None if src is None else src + k
        whole = draft and k == len(draft) and t + k < len(answer)
        src = nxt + 1 if whole and nxt < len(full) - 1 and full[nxt] == answer[t + k] else None
        t += k + 1
    return steps, drafted, accepted, unmatched


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://localhost:8392")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompts", default="bench/spec/edit_long_prompts.txt")
    ap.add_argument("--max-tokens", type=int, default=320)
    args = ap.parse_args()
    tok = Tokenizer.from_file(args.tokenizer)
    pairs = []
    for msg, ans in answers(args.url, args.prompts, args.max_tokens):
        chat = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n"
        pairs.append((tok.encode(chat).ids, tok.encode(ans).ids + [2]))  # 2: <|im_end|>
    for cap in (4, 8, 16):
        for cursor in (False, True):
            tot = [0, 0, 0, 0]
            tokens = sum(len(a) for _, a in pairs)
            for p, a in pairs:
                tot = [x + y for x, y in zip(tot, replay(p, a, cap, cursor))]
            steps, drafted, accepted, unmatched = tot
            print(f"cap {cap:2} {'cursor' if cursor else 'latest'}: {tokens} tokens in {steps} steps "
                  f"({tokens / steps:.2f} a step), {drafted} drafted, {accepted} accepted "
                  f"({accepted / max(drafted, 1):.2f}), {unmatched} steps without a match")


if __name__ == "__main__":
    main()
