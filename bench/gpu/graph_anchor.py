"""The strong PyTorch anchor of issue 21: a plain Llama decode loop with a
static KV cache, compiled with `torch.compile` and replayed as a CUDA graph
(the gpt-fast recipe), written for this bench.

    python3 bench/gpu/graph_anchor.py make  DIR [--config config.json]
    python3 bench/gpu/graph_anchor.py bench DIR --batches 1,16,64

`make` draws random bf16 weights (seeded, on the GPU) for the 1B-class
shape of `hf_anchor.py`, or for the shape of a Hugging Face `config.json`
(e.g. SmolLM2-135M-Instruct's), and saves them in Hugging Face format, so
Tandem loads the very same weights.

`bench` loads DIR's safetensors into the model below, checks it against
transformers' `LlamaForCausalLM` on one prompt (logits and greedy tokens),
then prefills B prompts of 128 random token ids and decodes 128 new tokens
per sequence. The decode step (embedding, every layer, final norm,
unembedding, argmax) is one function, `Llama.next_token`, compiled with
`mode="reduce-overhead"`, which captures it in a CUDA graph per batch size
and replays it; the KV cache is a static `[B, kv_heads, max_len, head_dim]`
buffer written in place at the step's position, and attention runs over
the whole buffer with a causal mask (as gpt-fast does). Decode tokens/s =
B x 127 / (time of the 128th token - time of the 1st), the device
synchronised, the median of `--reps` runs after two warm-up runs (which
include compilation and capture). The same figure is printed for the
eager loop (no compilation) beside it.
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from hf_anchor import SHAPE


def make(out_dir: str, config_path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if config_path:
        with open(config_path) as f:
            config = LlamaConfig(**json.load(f))
    else:
        config = LlamaConfig(**SHAPE)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {out_dir}: {params / 1e6:.0f} M parameters, bf16", flush=True)


class Block(torch.nn.Module):
    """One layer's weights (fused q/k/v and gate/up) and its static KV cache,
    all registered buffers, so the compiled graph reads them in place."""

    def __init__(self, w: dict, p: str, kv_shape):
        super().__init__()
        cat = torch.cat
        self.register_buffer("wqkv", cat([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]))
        self.register_buffer("wo", w[p + "self_attn.o_proj.weight"])
        self.register_buffer("w13", cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]))
        self.register_buffer("w2", w[p + "mlp.down_proj.weight"])
        self.register_buffer("n1", w[p + "input_layernorm.weight"])
        self.register_buffer("n2", w[p + "post_attention_layernorm.weight"])
        self.register_buffer("k_cache", torch.zeros(kv_shape, device="cuda", dtype=torch.bfloat16))
        self.register_buffer("v_cache", torch.zeros(kv_shape, device="cuda", dtype=torch.bfloat16))


class Llama(torch.nn.Module):
    """A Llama with a static KV cache: `forward(ids [B, T], pos [T])` writes
    K/V at positions `pos` (the same for every sequence, as in the bench)
    and returns the last position's logits `[B, vocab]` (f32)."""

    def __init__(self, cfg: dict, state: dict, batch: int, max_len: int):
        super().__init__()
        dev, dt = "cuda", torch.bfloat16
        self.nh = cfg["num_attention_heads"]
        self.nkv = cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.inter = cfg["intermediate_size"]
        w = {k: v.to(dev, dt) for k, v in state.items()}
        self.register_buffer("embed", w["model.embed_tokens.weight"])
        self.register_buffer("lm_head", w.get("lm_head.weight", w["model.embed_tokens.weight"]))
        self.register_buffer("norm", w["model.norm.weight"])
        kv_shape = (batch, self.nkv, max_len, self.hd)
        self.blocks = torch.nn.ModuleList(
            Block(w, f"model.layers.{i}.", kv_shape) for i in range(cfg["num_hidden_layers"])
        )
        # transformers 5 writes it under `rope_parameters`.
        theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, device=dev).float() / self.hd))
        ang = torch.outer(torch.arange(max_len, device=dev).float(), inv)
        self.register_buffer("cos", ang.cos().to(dt))
        self.register_buffer("sin", ang.sin().to(dt))
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool, device=dev)))

    def rms(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * w

    def rope(self, x, pos):
        # x [B, heads, T, hd]; half-split rotation (Hugging Face's layout).
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, ids, pos):
        b, t = ids.shape
        x = F.embedding(ids, self.embed)
        mask = self.causal[pos][None, None]  # [1, 1, T, max_len]
        q_dim, kv_dim = self.nh * self.hd, self.nkv * self.hd
        for blk in self.blocks:
            h = self.rms(x, blk.n1)
            q, k, v = (h @ blk.wqkv.T).split([q_dim, kv_dim, kv_dim], dim=-1)
            q = self.rope(q.view(b, t, self.nh, self.hd).transpose(1, 2), pos)
            k = self.rope(k.view(b, t, self.nkv, self.hd).transpose(1, 2), pos)
            v = v.view(b, t, self.nkv, self.hd).transpose(1, 2)
            blk.k_cache.index_copy_(2, pos, k)
            blk.v_cache.index_copy_(2, pos, v)
            a = F.scaled_dot_product_attention(
                q, blk.k_cache, blk.v_cache, attn_mask=mask, enable_gqa=True
            )
            x = x + a.transpose(1, 2).reshape(b, t, q_dim) @ blk.wo.T
            h = self.rms(x, blk.n2)
            g, u = (h @ blk.w13.T).split([self.inter, self.inter], dim=-1)
            x = x + (F.silu(g) * u) @ blk.w2.T
        return (self.rms(x[:, -1], self.norm) @ self.lm_head.T).float()

    def next_token(self, ids, pos):
        """One greedy step: the token ids `[B, 1]` after `ids`."""
        return self.forward(ids, pos).argmax(-1, keepdim=True)


def load(model_dir: str):
    from safetensors.torch import load_file
    import glob

    with open(f"{model_dir}/config.json") as f:
        cfg = json.load(f)
    state = {}
    for path in sorted(glob.glob(f"{model_dir}/*.safetensors")):
        state.update(load_file(path, device="cuda"))
    return cfg, state


def check(model_dir: str, cfg: dict, state: dict) -> None:
    """This model against transformers' on one prompt: logits and 16 greedy
    tokens (bf16 both; the sums differ in order, so logits agree to bf16
    rounding, not bit for bit)."""
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(3, cfg["vocab_size"], (1, 32), generator=torch.Generator().manual_seed(7)).cuda()
    mine = Llama(cfg, state, 1, 64)
    with torch.inference_mode():
        want = ref(ids).logits[:, -1].float()
        got = mine(ids, torch.arange(32, device="cuda"))
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                           do_sample=False, pad_token_id=0, disable_compile=True)
        toks, tok = [], got.argmax(-1, keepdim=True)
        for p in range(32, 48):
            toks.append(tok)
            tok = mine.next_token(tok, torch.tensor([p], device="cuda"))
    diff = (want - got).abs().max().item()
    same = sum(int(a == b) for a, b in zip(torch.cat(toks, 1)[0].tolist(), out[0, 32:].tolist()))
    print(f"check against transformers: max |logit diff| {diff:.3f} "
          f"(logit range {want.abs().max().item():.1f}), greedy tokens equal {same}/16", flush=True)
    del ref
    torch.cuda.empty_cache()


def decode_seconds(model, step, prompts, new: int) -> float:
    """Prefill, then `new` tokens; seconds from the first token to the last."""
    b, p = prompts.shape
    tok = model.next_token(prompts, torch.arange(p, device="cuda"))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(new - 1):
        pos = torch.tensor([p + i], device="cuda")
        # The graph's output buffer is overwritten by the next replay.
        tok = step(tok, pos).clone()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def profile_kernels(model, step, prompts, steps: int, name: str) -> None:
    """The GPU kernels of `steps` decode steps by the PyTorch profiler
    (CUPTI; a replayed graph's kernels included): per kernel, the time a
    step and the launches a step, longest first, and their sum."""
    from torch.profiler import ProfilerActivity, profile

    b, p = prompts.shape
    tok = model.next_token(prompts, torch.arange(p, device="cuda"))
    tok = step(tok, torch.tensor([p], device="cuda")).clone()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(1, steps + 1):
            tok = step(tok, torch.tensor([p + i], device="cuda")).clone()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us > 0:
            rows.append((us / steps, e.count / steps, e.key))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    print(f"profile {name} B={b}: {total:.1f} us of kernels a step, "
          f"{sum(r[1] for r in rows):.0f} launches a step", flush=True)
    for us, count, key in rows[:25]:
        print(f"  {us:9.1f} us {count:6.1f}x  {key[:110]}", flush=True)


def bench(model_dir: str, batches, prompt: int, new: int, reps: int, skip_check: bool,
          profile_steps: int = 0) -> None:
    cfg, state = load(model_dir)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, {model_dir}", flush=True)
    if not skip_check:
        check(model_dir, cfg, state)
    results = {}
    gen = torch.Generator().manual_seed(1)
    for b in batches:
        model = Llama(cfg, state, b, prompt + new)
        prompts = torch.randint(3, cfg["vocab_size"], (b, prompt), generator=gen).cuda()
        compiled = torch.compile(model.next_token, mode="reduce-overhead", fullgraph=True)
        for name, step in (("graph (torch.compile, reduce-overhead)", compiled), ("eager", model.next_token)):
            with torch.inference_mode():
                t0 = time.perf_counter()
                for _ in range(2):
                    decode_seconds(model, step, prompts, new)
                warm = time.perf_counter() - t0
                runs = [decode_seconds(model, step, prompts, new) for _ in range(reps)]
            decode = statistics.median(runs)
            tps = b * (new - 1) / decode
            results[f"{name} B={b}"] = tps
            print(f"{name:<40} B={b:<3} decode {tps:9.1f} tok/s "
                  f"({1e3 * decode / (new - 1):.3f} ms/step; runs "
                  f"{', '.join(f'{b * (new - 1) / r:.0f}' for r in runs)}; warm-up {warm:.1f} s)",
                  flush=True)
            if profile_steps:
                with torch.inference_mode():
                    profile_kernels(model, step, prompts, profile_steps, name.split()[0])
        del model, compiled
        torch.cuda.empty_cache()
    print("json " + json.dumps(results), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["make", "bench"])
    p.add_argument("dir")
    p.add_argument("--config", help="make: a Hugging Face config.json to take the shape from")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="bench: print each kernel's time over STEPS decode steps (PyTorch profiler)")
    a = p.parse_args()
    if a.what == "make":
        make(a.dir, a.config)
    else:
        bench(a.dir, [int(b) for b in a.batches.split(",")], a.prompt, a.new, a.reps, a.skip_check,
              a.profile)


if __name__ == "__main__":
    sys.exit(main())
