"""The PyTorch anchor of issue 8: a random-weight 1B-class Llama in bf16
through transformers `generate` (static cache, greedy) on the GPU.

    python3 bench/gpu/hf_anchor.py make  DIR   # writes the model (config + safetensors)
    python3 bench/gpu/hf_anchor.py bench DIR --batches 1,16,64

`make` draws the weights on the GPU (seeded) and saves them in Hugging Face
format, so Tandem loads the very same weights. `bench` prefills B prompts
of 128 random token ids and generates 128 new tokens per sequence. A
stopping criterion (which returns "go on") notes the time after each
generated token, the device synchronised: decode tokens/s = B x 127 / (time
of the 128th token - time of the 1st), the median of three runs after a
warm-up run (which includes any compilation that transformers does for the
static cache). It runs `generate` as configured by default and then with
compilation disabled, and prints both.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def make(out_dir: str) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPE)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out_dir}: {params / 1e6:.0f} M parameters, bf16", flush=True)


class TokenClock(transformers.StoppingCriteria):
    """Notes when each generated token exists on the host; never stops."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores, **kwargs):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def decode_seconds(model, ids, new_tokens: int, compile_off: bool) -> float:
    """Seconds from the first generated token to the last."""
    clock = TokenClock()
    kwargs = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
        pad_token_id=0,
        stopping_criteria=transformers.StoppingCriteriaList([clock]),
    )
    if compile_off:
        kwargs["disable_compile"] = True
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    assert len(clock.times) == new_tokens, len(clock.times)
    return clock.times[-1] - clock.times[0]


def bench(model_dir: str, batches, prompt: int, new: int, reps: int) -> None:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    gen = torch.Generator().manual_seed(1)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{torch.cuda.get_device_name(0)}",
        flush=True,
    )
    results = {}
    for compile_off in (False, True):
        mode = "generate, compile off" if compile_off else "generate (default)"
        for b in batches:
            ids = torch.randint(3, SHAPE["vocab_size"], (b, prompt), generator=gen).cuda()
            t0 = time.perf_counter()
            with torch.inference_mode():
                decode_seconds(model, ids, new, compile_off)  # warm-up
                warm = time.perf_counter() - t0
                runs = [decode_seconds(model, ids, new, compile_off) for _ in range(reps)]
            decode = statistics.median(runs)
            tps = b * (new - 1) / decode
            results[f"{mode} B={b}"] = tps
            print(
                f"{mode:<24} B={b:<3} decode {tps:9.1f} tok/s "
                f"({1e3 * decode / (new - 1):.2f} ms/step; warm-up run {warm:.1f} s)",
                flush=True,
            )
    print("json " + json.dumps(results), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["make", "bench"])
    p.add_argument("dir")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    if a.what == "make":
        make(a.dir)
    else:
        bench(a.dir, [int(b) for b in a.batches.split(",")], a.prompt, a.new, a.reps)


if __name__ == "__main__":
    sys.exit(main())
