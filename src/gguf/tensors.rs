//! GGUF tensors as the Hugging Face tensors [`Model::load`] expects.
//!
//! Three translations:
//! - names: `blk.N.attn_q.weight` → `model.layers.N.self_attn.q_proj.weight`
//!   and so on ([`gguf_name`] maps the other way, so errors name the
//!   tensor as it is in the file);
//! - shapes: GGML lists dimensions innermost first, the reverse of the
//!   row-major shape;
//! - values: every supported type is dequantised to f32 with candle's GGML
//!   block code, or, with [`Blocks::Keep`], weight matrices stored in GGML
//!   blocks stay in them; for `llama` the q/k rows are un-permuted either way
//!   (rows of blocks are whole byte runs, so that is a row reorder).
//!
//! # The q/k permutation
//! llama.cpp's RoPE for `llama` pairs dimensions (2i, 2i+1) (interleaved);
//! Hugging Face checkpoints pair (i, i + d/2) (rotate-half), which is what
//! Tandem's model computes. llama.cpp's converter therefore permutes q and k
//! rows per head: `w.reshape(n_head, 2, d/2, hidden).swapaxes(1, 2)`.
//! [`unpermute`] applies the inverse (`reshape(n_head, d/2, 2, hidden)
//! .swapaxes(1, 2)`), with `n_kv_heads` for k. Skipping it does not fail
//! loudly: the model runs and produces garbage. `qwen2` uses rotate-half in
//! llama.cpp too, so its tensors are stored unpermuted.
//!
//! [`Model::load`]: crate::model::Model::load

use std::collections::HashMap;

use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

use super::{GgufError, GgufFile, TensorInfo};
use crate::model::linear::qtensor_from_bytes;
use crate::model::weights::tensor_shapes;
use crate::model::{Architecture, ModelConfig, Weights};

/// Per-layer tensor names: (GGUF suffix, Hugging Face suffix).
const LAYER_NAMES: [(&str, &str); 13] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("ffn_gate.weight", "mlp.gate_proj.weight"),
    ("ffn_up.weight", "mlp.up_proj.weight"),
    ("ffn_down.weight", "mlp.down_proj.weight"),
    ("attn_output.bias", "self_attn.o_proj.bias"),
];

/// Whole-model tensor names: (GGUF, Hugging Face).
const MODEL_NAMES: [(&str, &str); 3] = [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// Tensors a GGUF may hold that are metadata for Tandem, not weights.
const NOT_WEIGHTS: [&str; 1] = ["rope_freqs.weight"];

/// The Hugging Face name of a GGUF tensor, if it is one Tandem knows.
pub fn hf_name(gguf: &str) -> Option<String> {
    if let Some(&(_, hf)) = MODEL_NAMES.iter().find(|(g, _)| *g == gguf) {
        return Some(hf.to_string());
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let &(_, hf) = LAYER_NAMES.iter().find(|(g, _)| *g == suffix)?;
    Some(format!("model.layers.{layer}.{hf}"))
}

/// The GGUF name of a Hugging Face tensor, if it has one.
pub fn gguf_name(hf: &str) -> Option<String> {
    if let Some(&(g, _)) = MODEL_NAMES.iter().find(|(_, h)| *h == hf) {
        return Some(g.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let &(g, _) = LAYER_NAMES.iter().find(|(_, h)| *h == suffix)?;
    Some(format!("blk.{layer}.{g}"))
}

/// The tensor's values as f32, in its row-major shape, on the CPU.
pub fn dequantize(file: &GgufFile, info: &TensorInfo) -> Result<Tensor, GgufError> {
    let err = |source| GgufError::Tensor {
        tensor: info.name.clone(),
        source,
    };
    let Some(dtype) = info.ggml_type.candle() else {
        // The reader rejects these; kept so this function stands alone.
        return Err(GgufError::UnsupportedTensorType {
            tensor: info.name.clone(),
            type_name: info.ggml_type.name().unwrap_or("unknown"),
        });
    };
    let bytes = file.tensor_bytes(info);
    // candle reinterprets the bytes as blocks without checking alignment;
    // blocks need at most 4-byte alignment. A mapped file with
    // `general.alignment` ≥ 4 always provides it; a buffer may not, and
    // then `qtensor_from_bytes` copies to aligned memory.
    let q = if (bytes.as_ptr() as usize).is_multiple_of(8) {
        qtensor_from_ggml(dtype, bytes, info.shape(), &Device::Cpu)
    } else {
        qtensor_from_bytes(dtype, bytes, &info.shape())
    }
    .map_err(err)?;
    q.dequantize(&Device::Cpu).map_err(err)
}

/// Undoes llama.cpp's per-head interleaving of q/k rows (see the module doc).
pub fn unpermute(t: &Tensor, n_head: usize) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    let head_dim = rows / n_head;
    let rest: usize = dims[1..].iter().product();
    t.reshape((n_head, head_dim / 2, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// Whether weight matrices stored in GGML blocks stay in them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocks {
    /// Every tensor dequantised to f32.
    Dequantise,
    /// Matrices (projections, embeddings) of a block type kept as blocks.
    Keep,
}

/// One weight, as it will be handed to the model.
enum Loaded {
    Dense(Tensor),
    Blocks(Box<QTensor>),
}

/// Whether `hf` names a weight matrix (what can stay in blocks).
fn is_matrix(hf: &str) -> bool {
    hf.ends_with("_proj.weight") || hf == "lm_head.weight" || hf == "model.embed_tokens.weight"
}

/// The tensor's GGML blocks, q/k rows un-permuted for `permuted_heads`.
fn blocks(
    file: &GgufFile,
    info: &TensorInfo,
    permuted_heads: Option<usize>,
) -> Result<QTensor, GgufError> {
    let dtype = info
        .ggml_type
        .candle()
        .ok_or_else(|| GgufError::UnsupportedTensorType {
            tensor: info.name.clone(),
            type_name: info.ggml_type.name().unwrap_or("unknown"),
        })?;
    let shape = info.shape();
    let bytes = file.tensor_bytes(info);
    let unpermuted;
    let bytes = match permuted_heads {
        Some(n_head) => {
            unpermuted = unpermute_rows(bytes, shape[0], n_head);
            &unpermuted[..]
        }
        None => bytes,
    };
    qtensor_from_bytes(dtype, bytes, &shape).map_err(|source| GgufError::Tensor {
        tensor: info.name.clone(),
        source,
    })
}

/// [`unpermute`] on rows of raw bytes: new row `h·d + j·d/2 + i` is old
/// row `h·d + 2i + j`.
fn unpermute_rows(bytes: &[u8], rows: usize, n_head: usize) -> Vec<u8> {
    let row = bytes.len() / rows;
    let head_dim = rows / n_head;
    let mut out = Vec::with_capacity(bytes.len());
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..head_dim / 2 {
                let old = h * head_dim + 2 * i + j;
                out.extend_from_slice(&bytes[old * row..(old + 1) * row]);
            }
        }
    }
    out
}

/// Every weight `cfg` needs, dequantised to f32 under its Hugging Face name.
/// Errors name the tensor as the file names it. Returns the weights and a
/// count of the source types (for the load log).
///
/// Tensors are dequantised on all cores (a 135M-parameter model's 98 MB of
/// Q4_1 is half a second of single-threaded block decoding).
/// With [`Blocks::Keep`], weight matrices of a block type stay in blocks
/// ([`Weights::Quantized`]).
pub fn hf_weights(
    file: &GgufFile,
    cfg: &ModelConfig,
    keep: Blocks,
) -> Result<(Weights, HashMap<&'static str, usize>), GgufError> {
    let mut types: HashMap<&'static str, usize> = HashMap::new();
    let mut jobs: Vec<(String, &TensorInfo, Option<usize>)> = Vec::new();
    for (hf, shape) in tensor_shapes(cfg) {
        let gguf = gguf_name(&hf).ok_or_else(|| GgufError::MissingTensor(hf.clone()))?;
        let info = file
            .tensor(&gguf)
            .ok_or_else(|| GgufError::MissingTensor(gguf.clone()))?;
        if info.shape() != shape {
            return Err(GgufError::bad_tensor(
                &gguf,
                format!(
                    "dimensions {:?} do not match the metadata (expected {:?})",
                    info.dims,
                    shape.iter().rev().collect::<Vec<_>>()
                ),
            ));
        }
        *types
            .entry(info.ggml_type.name().unwrap_or("?"))
            .or_default() += 1;
        let permuted_heads = match cfg.architecture {
            Architecture::Llama if hf.contains(".q_proj.") => Some(cfg.num_heads),
            Architecture::Llama if hf.contains(".k_proj.") => Some(cfg.num_kv_heads),
            _ => None,
        };
        jobs.push((hf, info, permuted_heads));
    }
    // Largest first, so the threads finish together.
    jobs.sort_by_key(|(_, info, _)| std::cmp::Reverse(info.elem_count()));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 16)
        .min(jobs.len().max(1));
    let work = || -> Result<Vec<(String, Loaded)>, GgufError> {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some((hf, info, heads)) = jobs.get(i) else {
                return Ok(done);
            };
            let is_blocks = !matches!(
                info.ggml_type.candle(),
                Some(GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) | None
            );
            if keep == Blocks::Keep && is_blocks && is_matrix(hf) {
                done.push((
                    hf.clone(),
                    Loaded::Blocks(Box::new(blocks(file, info, *heads)?)),
                ));
                continue;
            }
            let mut t = dequantize(file, info)?;
            if let Some(n) = *heads {
                t = unpermute(&t, n).map_err(|source| GgufError::Tensor {
                    tensor: info.name.clone(),
                    source,
                })?;
            }
            done.push((hf.clone(), Loaded::Dense(t)));
        }
    };
    let results: Vec<Result<Vec<(String, Loaded)>, GgufError>> = std::thread::scope(|s| {
        let handles: Vec<_> = (1..threads).map(|_| s.spawn(work)).collect();
        let mut results = vec![work()];
        for h in handles {
            results.push(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        }
        results
    });
    let (mut map, mut kept) = (HashMap::with_capacity(jobs.len()), HashMap::new());
    for r in results {
        for (hf, loaded) in r? {
            match loaded {
                Loaded::Dense(t) => {
                    map.insert(hf, t);
                }
                Loaded::Blocks(b) => {
                    kept.insert(hf, std::sync::Arc::new(*b));
                }
            }
        }
    }
    let unused: Vec<&str> = file
        .tensors()
        .iter()
        .map(|t| t.name.as_str())
        .filter(|n| !NOT_WEIGHTS.contains(n))
        .filter(|n| hf_name(n).is_none_or(|hf| !map.contains_key(&hf) && !kept.contains_key(&hf)))
        .collect();
    if !unused.is_empty() {
        tracing::warn!(
            count = unused.len(),
            first = unused[0],
            "GGUF tensors not used by the model"
        );
    }
    let weights = if kept.is_empty() {
        Weights::Memory(map)
    } else {
        Weights::Quantized {
            dense: map,
            blocks: kept,
        }
    };
    Ok((weights, types))
}
