//! Where a model's tensors come from: safetensors files on disk (one file or
//! a sharded `model.safetensors.index.json`), or tensors built in memory
//! (the embedded default model, random benchmark models).
//!
//! Every lookup checks the tensor's shape and converts it to the compute
//! dtype on the target device; failures name the file and the tensor.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use candle_core::quantized::QTensor;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::{ModelConfig, ModelError};

/// A source of named tensors.
pub enum Weights {
    /// Memory-mapped safetensors; `files[i]` holds the tensors routed to it.
    Files {
        st: MmapedSafetensors,
        routing: HashMap<String, PathBuf>,
    },
    /// Tensors already in memory (random or generated weights).
    Memory(HashMap<String, Tensor>),
    /// A quantised checkpoint (GGUF): `dense` tensors, and matrices kept in
    /// their GGML `blocks` (read dense through [`Weights::get`], which
    /// dequantises them, or as blocks through [`Weights::blocks`]).
    Quantized {
        dense: HashMap<String, Tensor>,
        blocks: HashMap<String, Arc<QTensor>>,
    },
}

impl Weights {
    /// Opens `model.safetensors`, or the shards listed by
    /// `model.safetensors.index.json`, in `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let (files, routing): (Vec<PathBuf>, HashMap<String, PathBuf>) = if index_path.exists() {
            let text = std::fs::read_to_string(&index_path).map_err(|e| ModelError::Io {
                path: index_path.clone(),
                source: e,
            })?;
            let json: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| ModelError::Weights {
                    path: index_path.clone(),
                    reason: format!("invalid JSON: {e}"),
                })?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Weights {
                    path: index_path.clone(),
                    reason: "no `weight_map` object".into(),
                })?;
            let mut files: Vec<PathBuf> = Vec::new();
            let mut routing = HashMap::new();
            for (name, file) in map {
                let file = file.as_str().ok_or_else(|| ModelError::Weights {
                    path: index_path.clone(),
                    reason: format!("weight_map entry `{name}` is not a file name"),
                })?;
                let path = dir.join(file);
                if !files.contains(&path) {
                    files.push(path.clone());
                }
                routing.insert(name.clone(), path);
            }
            (files, routing)
        } else if single.exists() {
            (vec![single], HashMap::new())
        } else {
            return Err(ModelError::Weights {
                path: single,
                reason: "no model.safetensors or model.safetensors.index.json".into(),
            });
        };
        for f in &files {
            if !f.exists() {
                return Err(ModelError::Weights {
                    path: f.clone(),
                    reason: "shard listed in the index is missing".into(),
                });
            }
        }
        // SAFETY: the files are mapped read-only; like every mmap-based loader we
        // assume nobody truncates them while the model is loaded.
        let st = unsafe { MmapedSafetensors::multi(&files) }.map_err(|e| ModelError::Weights {
            path: files[0].clone(),
            reason: format!("cannot read safetensors: {e}"),
        })?;
        let routing = if routing.is_empty() {
            st.tensors()
                .into_iter()
                .map(|(name, _)| (name, files[0].clone()))
                .collect()
        } else {
            routing
        };
        Ok(Weights::Files { st, routing })
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        match self {
            Weights::Files { routing, .. } => routing.contains_key(name),
            Weights::Memory(map) => map.contains_key(name),
            Weights::Quantized { dense, blocks } => {
                dense.contains_key(name) || blocks.contains_key(name)
            }
        }
    }

    /// `name` in its GGML blocks, when the checkpoint stores it so.
    pub(crate) fn blocks(&self, name: &str) -> Option<&QTensor> {
        match self {
            Weights::Quantized { blocks, .. } => blocks.get(name).map(|b| b.as_ref()),
            _ => None,
        }
    }

    fn origin(&self, name: &str) -> PathBuf {
        match self {
            Weights::Files { routing, .. } => routing
                .get(name)
                .cloned()
                .unwrap_or_else(|| PathBuf::from("model.safetensors")),
            Weights::Memory(_) | Weights::Quantized { .. } => PathBuf::from("<memory>"),
        }
    }

    /// Loads `name`, checks it has `shape`, converts it to `dtype` on `device`.
    pub fn get(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor, ModelError> {
        let path = self.origin(name);
        let tensor = match self {
            Weights::Files { st, routing } => {
                if !routing.contains_key(name) {
                    return Err(ModelError::MissingTensor {
                        path,
                        name: name.to_string(),
                    });
                }
                st.load(name, device).map_err(|e| ModelError::Weights {
                    path: path.clone(),
                    reason: format!("tensor `{name}`: {e}"),
                })?
            }
            Weights::Memory(map) => {
                map.get(name)
                    .cloned()
                    .ok_or_else(|| ModelError::MissingTensor {
                        path: path.clone(),
                        name: name.to_string(),
                    })?
            }
            Weights::Quantized { dense, blocks } => match (dense.get(name), blocks.get(name)) {
                (Some(t), _) => t.clone(),
                (None, Some(b)) => b.dequantize(&Device::Cpu)?,
                (None, None) => {
                    return Err(ModelError::MissingTensor {
                        path,
                        name: name.to_string(),
                    })
                }
            },
        };
        if tensor.dims() != shape {
            return Err(ModelError::ShapeMismatch {
                path,
                name: name.to_string(),
                expected: shape.to_vec(),
                found: tensor.dims().to_vec(),
            });
        }
        let convert =
            |t: Tensor| -> candle_core::Result<Tensor> { t.to_device(device)?.to_dtype(dtype) };
        convert(tensor).map_err(|e| ModelError::Weights {
            path,
            reason: format!("tensor `{name}`: {e}"),
        })
    }

    /// Deterministic random weights for `cfg` (uniform with std 0.02 for
    /// projections, norms at 1.0). `lm_head_std` sets the unembedding's
    /// spread: a larger one gives peaky, well-separated logits, which keeps
    /// greedy decoding of a random model far from argmax ties.
    pub fn random(cfg: &ModelConfig, seed: u64, lm_head_std: f32) -> Result<Self, ModelError> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut map = HashMap::new();
        let cpu = Device::Cpu;
        let mut uniform = |shape: &[usize], std: f32| -> Result<Tensor, ModelError> {
            let n: usize = shape.iter().product();
            let a = std * 3f32.sqrt();
            let data: Vec<f32> = (0..n).map(|_| rng.random_range(-a..a)).collect();
            Tensor::from_vec(data, shape, &cpu).map_err(ModelError::from)
        };
        let ones =
            |shape: &[usize]| Tensor::ones(shape, DType::F32, &cpu).map_err(ModelError::from);
        for (name, shape) in tensor_shapes(cfg) {
            let t = if name.ends_with("norm.weight") {
                ones(&shape)?
            } else if name.ends_with(".bias") {
                uniform(&shape, 0.02)?
            } else if name == "lm_head.weight"
                || (cfg.tie_word_embeddings && name == "model.embed_tokens.weight")
            {
                uniform(&shape, lm_head_std)?
            } else if name == "model.embed_tokens.weight" {
                uniform(&shape, 1.0)?
            } else {
                uniform(&shape, 0.02)?
            };
            map.insert(name, t);
        }
        Ok(Weights::Memory(map))
    }
}

/// A deterministic tensor, uniform with standard deviation `std`.
pub fn uniform_tensor(shape: &[usize], std: f32, seed: u64) -> Result<Tensor, ModelError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let a = std * 3f32.sqrt();
    let data: Vec<f32> = (0..shape.iter().product())
        .map(|_| rng.random_range(-a..a))
        .collect();
    Ok(Tensor::from_vec(data, shape, &Device::Cpu)?)
}

/// Every tensor a Llama-family checkpoint of `cfg` holds, with its shape.
pub fn tensor_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i, hd) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (q, kv) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    for l in 0..cfg.num_layers {
        let p = format!("model.layers.{l}");
        out.push((format!("{p}.input_layernorm.weight"), vec![h]));
        out.push((format!("{p}.self_attn.q_proj.weight"), vec![q, h]));
        out.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h]));
        out.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h]));
        if cfg.attention_bias {
            out.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
            out.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
            out.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
        }
        out.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        out.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h]));
        out.push((format!("{p}.mlp.up_proj.weight"), vec![i, h]));
        out.push((format!("{p}.mlp.down_proj.weight"), vec![h, i]));
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// Writes `weights` (which must be in memory) as `dir/model.safetensors`.
pub fn save_safetensors(weights: &Weights, path: &Path) -> Result<(), ModelError> {
    match weights {
        Weights::Memory(map) => {
            candle_core::safetensors::save(map, path).map_err(|e| ModelError::Weights {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })
        }
        Weights::Files { .. } | Weights::Quantized { .. } => Err(ModelError::Weights {
            path: path.to_path_buf(),
            reason: "only in-memory dense weights can be saved".into(),
        }),
    }
}
