# Random-weight GGUF (f32) for llama-batched-bench and Tandem's forward
# bench: N(0, 0.02^2) weights, norms at 1.0, and a dummy SPM vocabulary
# (speed does not depend on either). SHAPE is `llama-100m` (the shape of
# ../shared/bench/llama-100m, the default) or `smollm2` (SmolLM2-135M's:
# 30 layers, tied embeddings, a 49 152-token vocabulary), for hosts the
# real file cannot be copied to.
# Run with llama.cpp's gguf-py on PYTHONPATH:
#   PYTHONPATH=llama.cpp/gguf-py python3 bench/cpu/make_gguf.py OUT.gguf [SHAPE]
import sys
import numpy as np
import gguf

out = sys.argv[1]
shape = sys.argv[2] if len(sys.argv) > 2 else "llama-100m"
H, I, L, NH, NKV, V, HD, THETA, TIED = {
    "llama-100m": (768, 2048, 12, 12, 4, 32000, 64, 10000.0, False),
    "smollm2": (576, 1536, 30, 9, 3, 49152, 64, 100000.0, True),
}[shape]
rng = np.random.default_rng(0)
w = gguf.GGUFWriter(out, "llama")
w.add_context_length(2048)
w.add_embedding_length(H)
w.add_block_count(L)
w.add_feed_forward_length(I)
w.add_rope_dimension_count(HD)
w.add_head_count(NH)
w.add_head_count_kv(NKV)
w.add_layer_norm_rms_eps(1e-5)
w.add_rope_freq_base(THETA)
w.add_file_type(gguf.LlamaFileType.ALL_F32)
w.add_tokenizer_model("llama")
w.add_token_list([b"<unk>", b"<s>", b"</s>"] + [f"t{i}".encode() for i in range(3, V)])
w.add_token_scores([0.0] * V)
w.add_token_types([2, 3, 3] + [1] * (V - 3))
w.add_bos_token_id(1)
w.add_eos_token_id(2)
w.add_unk_token_id(0)

def rand(*shape):
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

w.add_tensor("token_embd.weight", rand(V, H))
for l in range(L):
    p = f"blk.{l}."
    w.add_tensor(p + "attn_norm.weight", np.ones(H, np.float32))
    w.add_tensor(p + "attn_q.weight", rand(NH * HD, H))
    w.add_tensor(p + "attn_k.weight", rand(NKV * HD, H))
    w.add_tensor(p + "attn_v.weight", rand(NKV * HD, H))
    w.add_tensor(p + "attn_output.weight", rand(H, NH * HD))
    w.add_tensor(p + "ffn_norm.weight", np.ones(H, np.float32))
    w.add_tensor(p + "ffn_gate.weight", rand(I, H))
    w.add_tensor(p + "ffn_up.weight", rand(I, H))
    w.add_tensor(p + "ffn_down.weight", rand(H, I))
w.add_tensor("output_norm.weight", np.ones(H, np.float32))
if not TIED:
    w.add_tensor("output.weight", rand(V, H))
w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
print("wrote", out)
