//! Hand-built GGUF files: every metadata type, every tensor type Tandem
//! dequantises, a tiny llama and qwen2 model against the same weights
//! loaded the Hugging Face way, and corrupted copies that must fail with a
//! typed error naming what is wrong (never a panic).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use super::writer::{GgufWriter, RawTensor};
use super::*;
use crate::model::{LoadOptions, Model, ModelConfig, Weights};

fn s(v: &str) -> Value {
    Value::String(v.to_string())
}

fn parse(w: &GgufWriter) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(w.to_bytes())
}

/// A file with one of each metadata type and two small f32 tensors.
fn sample() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.kv("u8", Value::U8(7))
        .kv("i8", Value::I8(-7))
        .kv("u16", Value::U16(700))
        .kv("i16", Value::I16(-700))
        .kv("u32", Value::U32(70_000))
        .kv("i32", Value::I32(-70_000))
        .kv("u64", Value::U64(1 << 40))
        .kv("i64", Value::I64(-(1 << 40)))
        .kv("f32", Value::F32(1e-5))
        .kv("f64", Value::F64(0.25))
        .kv("bool", Value::Bool(true))
        .kv("str", s("héllo"))
        .kv(
            "nested",
            Value::Array(
                ValueType::Array,
                vec![
                    Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(2)]),
                    Value::Array(ValueType::String, vec![s("a")]),
                ],
            ),
        )
        .kv("general.alignment", Value::U32(64));
    w.alignment = 64;
    w.f32_tensor("a", &[2, 3], &[1., 2., 3., 4., 5., 6.]);
    w.f32_tensor("b", &[4], &[7., 8., 9., 10.]);
    w
}

#[test]
fn every_metadata_type_round_trips_in_v2_and_v3() {
    for version in [2, 3] {
        let mut w = sample();
        w.version = version;
        let f = parse(&w).unwrap();
        assert_eq!(f.version, version);
        let got: Vec<(String, Value)> = f
            .metadata()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        assert_eq!(got, w.metadata);
        assert_eq!(f.usize("u64").unwrap(), 1 << 40);
        assert_eq!(
            f.f64("f32").unwrap(),
            1e-5,
            "f32 read as its shortest decimal"
        );
        assert_eq!(f.str("str").unwrap(), "héllo");
        assert_eq!(f.alignment, 64);
        let a = f.tensor("a").unwrap();
        assert_eq!((a.dims.clone(), a.shape()), (vec![3, 2], vec![2, 3]));
        let t = tensors::dequantize(&f, a).unwrap();
        assert_eq!(t.to_vec2::<f32>().unwrap(), [[1., 2., 3.], [4., 5., 6.]]);
        let b = tensors::dequantize(&f, f.tensor("b").unwrap()).unwrap();
        assert_eq!(b.to_vec1::<f32>().unwrap(), [7., 8., 9., 10.]);
    }
}

#[test]
fn typed_accessors_name_the_key() {
    let f = parse(&sample()).unwrap();
    let e = f.usize("missing.key").unwrap_err();
    assert!(
        matches!(&e, GgufError::MissingKey(k) if k == "missing.key"),
        "{e}"
    );
    let e = f.usize("i32").unwrap_err().to_string();
    assert!(e.contains("`i32`") && e.contains("non-negative"), "{e}");
    let e = f.str("u8").unwrap_err().to_string();
    assert!(e.contains("`u8`") && e.contains("a string"), "{e}");
}

#[test]
fn header_errors_are_typed() {
    let mut bytes = sample().to_bytes();
    bytes[0] = b'X';
    let e = GgufFile::from_bytes(bytes).unwrap_err();
    assert!(matches!(e, GgufError::BadMagic { .. }), "{e}");
    assert_eq!(e.error_type(), "gguf_corrupt");

    for (version, hint) in [
        (1u32, "version 1"),
        (4, ""),
        (3u32.swap_bytes(), "big-endian"),
    ] {
        let mut w = sample();
        w.version = version;
        let e = parse(&w).unwrap_err();
        assert!(
            matches!(e, GgufError::UnsupportedVersion { version: v, .. } if v == version),
            "{e}"
        );
        assert!(e.to_string().contains(hint), "{e}");
    }
    let e = GgufFile::from_bytes(b"GG".to_vec()).unwrap_err();
    assert!(matches!(e, GgufError::Truncated { .. }), "{e}");
}

#[test]
fn every_truncation_is_an_error_not_a_panic() {
    let bytes = sample().to_bytes();
    for len in 0..bytes.len() {
        let r = GgufFile::from_bytes(bytes[..len].to_vec());
        let e = r
            .err()
            .unwrap_or_else(|| panic!("truncated at {len} parsed"));
        assert!(
            matches!(e, GgufError::Truncated { .. } | GgufError::Limit { .. }),
            "truncated at {len}: {e}"
        );
    }
}

/// Overwrites the u64 at `at` in the image.
fn poke_u64(bytes: &mut [u8], at: usize, v: u64) {
    bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

#[test]
fn absurd_counts_and_lengths_are_limits_not_allocations() {
    let base = sample().to_bytes();
    // Tensor count, metadata count.
    for (at, what) in [(8, "tensor count"), (16, "metadata count")] {
        let mut b = base.clone();
        poke_u64(&mut b, at, u64::MAX);
        let e = GgufFile::from_bytes(b).unwrap_err();
        assert!(
            matches!(&e, GgufError::Truncated { what: w, .. } if w.contains(what)),
            "{e}"
        );
    }
    // The first key's length.
    let mut b = base.clone();
    poke_u64(&mut b, 24, 1 << 60);
    let e = GgufFile::from_bytes(b).unwrap_err();
    assert!(matches!(e, GgufError::Limit { .. }), "{e}");
    // An array length: a file whose only key is an array of 2^61 u64.
    let mut w = GgufWriter::new();
    w.kv("arr", Value::Array(ValueType::U64, vec![Value::U64(1)]));
    let mut b = w.to_bytes();
    let at = 24 + 8 + 3 + 4 + 4; // header, key, type, item type
    poke_u64(&mut b, at, 1 << 61);
    let e = GgufFile::from_bytes(b).unwrap_err();
    assert!(
        e.to_string().contains("array length of metadata `arr`"),
        "{e}"
    );
    // A length the bytes could back but over the per-array limit: a corrupt
    // length over tensor data must not become gigabytes of parsed values.
    let mut w = GgufWriter::new();
    w.kv("arr", Value::Array(ValueType::U8, vec![Value::U8(0)]));
    let mut b = w.to_bytes();
    poke_u64(&mut b, at, (1 << 22) + 1);
    b.resize(b.len() + (1 << 22) + 1, 0);
    let e = GgufFile::from_bytes(b).unwrap_err();
    assert!(
        matches!(e, GgufError::Limit { limit, .. } if limit == 1 << 22),
        "{e}"
    );
}

#[test]
fn wrong_tensor_count_is_caught() {
    // One more tensor than the infos: the parser reads the data as an info.
    let mut b = sample().to_bytes();
    poke_u64(&mut b, 8, 3);
    assert!(GgufFile::from_bytes(b).is_err());
    // One fewer: the last info is taken for padding; the tensor is absent
    // by name (a model load then names it as missing).
    let mut b = sample().to_bytes();
    poke_u64(&mut b, 8, 1);
    let f = GgufFile::from_bytes(b).unwrap();
    assert!(f.tensor("b").is_none());
}

#[test]
fn bad_tensor_infos_name_the_tensor() {
    let cases: Vec<(Vec<u64>, u32, &str)> = vec![
        (vec![1 << 50, 2], 0, "dimension"),
        (vec![1 << 39, 1 << 39, 1 << 39], 0, "overflow"),
        (vec![0, 4], 0, "dimension 0"),
        (vec![1, 1, 1, 1, 1], 0, "5 dimensions"),
        (vec![16, 2], 8, "block size 32"),
        (vec![32], 99, "unknown GGML type 99"),
        (vec![256], 16, "IQ2_XXS"),
        (vec![32], 9, "Q8_1"),
        (vec![1 << 20, 1 << 10], 0, "truncated"),
    ];
    for (dims, type_id, needle) in cases {
        let mut w = GgufWriter::new();
        w.raw_tensor(RawTensor {
            name: "blk.0.attn_q.weight".into(),
            dims: dims.clone(),
            type_id,
            data: vec![0; 128],
        });
        let e = parse(&w).unwrap_err().to_string();
        assert!(
            e.contains("blk.0.attn_q.weight") && e.contains(needle),
            "{dims:?} type {type_id}: {e}"
        );
    }
}

#[test]
fn misaligned_overlapping_or_outside_data_is_rejected() {
    let mut w = sample();
    w.kv("general.alignment", Value::U32(48));
    let e = parse(&w).unwrap_err();
    // A duplicate key is caught first; replace instead.
    assert!(matches!(e, GgufError::DuplicateKey(_)), "{e}");
    let mut w = sample();
    w.metadata.retain(|(k, _)| k != "general.alignment");
    w.kv("general.alignment", Value::U32(48));
    let e = parse(&w).unwrap_err().to_string();
    assert!(
        e.contains("general.alignment") && e.contains("power of two"),
        "{e}"
    );

    // Tensor b's offset (the last u64 of its info) moved off the alignment.
    let mut b = sample().to_bytes();
    let f = GgufFile::from_bytes(b.clone()).unwrap();
    let off_b = f.tensor("b").unwrap().offset;
    let pos = find_u64_after_name(&b, "b", off_b);
    poke_u64(&mut b, pos, off_b + 4);
    let e = GgufFile::from_bytes(b.clone()).unwrap_err().to_string();
    assert!(e.contains("`b`") && e.contains("alignment"), "{e}");
    poke_u64(&mut b, pos, 0);
    let e = GgufFile::from_bytes(b.clone()).unwrap_err().to_string();
    assert!(e.contains("overlaps"), "{e}");
    poke_u64(&mut b, pos, 1 << 40);
    let e = GgufFile::from_bytes(b).unwrap_err().to_string();
    assert!(e.contains("data of tensor `b`"), "{e}");
}

/// Position of tensor `name`'s offset field: the u64 with value `offset`
/// after its name in the tensor infos.
fn find_u64_after_name(bytes: &[u8], name: &str, offset: u64) -> usize {
    let mut needle = (name.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(name.as_bytes());
    let start = bytes
        .windows(needle.len())
        .rposition(|w| w == needle)
        .expect("tensor name in the infos");
    (start..bytes.len() - 8)
        .find(|&i| bytes[i..i + 8] == offset.to_le_bytes())
        .expect("offset after the name")
}

/// The GGML type id of a candle block format.
fn type_id(dt: GgmlDType) -> u32 {
    (0..64).find(|&i| GgmlType(i).candle() == Some(dt)).unwrap()
}

#[test]
fn every_supported_type_dequantises_like_candle() {
    let src = crate::model::weights::uniform_tensor(&[4, 512], 1.0, 3).unwrap();
    for dt in [
        GgmlDType::F32,
        GgmlDType::F16,
        GgmlDType::BF16,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q8_0,
        GgmlDType::Q2K,
        GgmlDType::Q3K,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ] {
        let q = QTensor::quantize(&src, dt).unwrap();
        let expected = q.dequantize(&Device::Cpu).unwrap();
        let mut w = GgufWriter::new();
        // An odd alignment puts the data off 4-byte boundaries in the buffer.
        w.alignment = 1;
        w.kv("general.alignment", Value::U32(1));
        w.kv("pad", s("x"));
        w.raw_tensor(RawTensor {
            name: "w".into(),
            dims: vec![512, 4],
            type_id: type_id(dt),
            data: q.data().unwrap().into_owned(),
        });
        let f = parse(&w).unwrap();
        let got = tensors::dequantize(&f, f.tensor("w").unwrap()).unwrap();
        assert_eq!(got.dims(), [4, 512]);
        let diff = (got - &expected).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{dt:?}");
        let err = (expected - &src)
            .unwrap()
            .abs()
            .unwrap()
            .mean_all()
            .unwrap();
        assert!(
            err.to_scalar::<f32>().unwrap() < 0.5,
            "{dt:?} is a lossy copy of the source"
        );
    }
}

#[test]
fn unpermute_inverts_llama_cpp_permute() {
    let (heads, hd, hidden) = (3, 8, 5);
    let hf = Tensor::arange(0f32, (heads * hd * hidden) as f32, &Device::Cpu)
        .unwrap()
        .reshape((heads * hd, hidden))
        .unwrap();
    let permuted = permute(&hf, heads);
    assert_ne!(
        permuted.to_vec2::<f32>().unwrap(),
        hf.to_vec2::<f32>().unwrap()
    );
    let back = tensors::unpermute(&permuted, heads).unwrap();
    assert_eq!(back.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
    // Row r of a head moves to 2r (first half) or 2(r - hd/2) + 1.
    let p = permuted.to_vec2::<f32>().unwrap();
    let h = hf.to_vec2::<f32>().unwrap();
    assert_eq!(p[2], h[1]);
    assert_eq!(p[1], h[hd / 2]);
}

/// llama.cpp's converter: `w.reshape(n, 2, d/2, rest).swapaxes(1, 2)`.
fn permute(t: &Tensor, n_head: usize) -> Tensor {
    let dims = t.dims().to_vec();
    let rest: usize = dims[1..].iter().product();
    t.reshape((n_head, 2, dims[0] / n_head / 2, rest))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape(dims)
        .unwrap()
}

fn tiny_config(arch: &str, tied: bool) -> ModelConfig {
    let json = serde_json::json!({
        "architectures": [arch],
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": tied,
    });
    ModelConfig::from_json(&json.to_string()).unwrap()
}

/// The GGUF llama.cpp's converter would write for `cfg` and `w`.
fn tiny_gguf(arch: &str, cfg: &ModelConfig, w: &Weights) -> GgufWriter {
    let Weights::Memory(map) = w else {
        unreachable!("random weights are in memory")
    };
    let mut g = GgufWriter::new();
    let k = |s: &str| format!("{arch}.{s}");
    g.kv("general.architecture", s(arch))
        .kv(
            &k("context_length"),
            Value::U32(cfg.max_position_embeddings as u32),
        )
        .kv(&k("embedding_length"), Value::U32(cfg.hidden_size as u32))
        .kv(
            &k("feed_forward_length"),
            Value::U32(cfg.intermediate_size as u32),
        )
        .kv(&k("block_count"), Value::U32(cfg.num_layers as u32))
        .kv(&k("attention.head_count"), Value::U32(cfg.num_heads as u32))
        .kv(
            &k("attention.head_count_kv"),
            Value::U32(cfg.num_kv_heads as u32),
        )
        .kv(
            &k("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_norm_eps as f32),
        )
        .kv(&k("rope.freq_base"), Value::F32(cfg.rope_theta as f32))
        .kv(&k("rope.dimension_count"), Value::U32(cfg.head_dim as u32));
    let mut names: Vec<&String> = map.keys().collect();
    names.sort();
    for hf in names {
        let mut t = map[hf].clone();
        if arch == "llama" && hf.contains(".q_proj.") {
            t = permute(&t, cfg.num_heads);
        } else if arch == "llama" && hf.contains(".k_proj.") {
            t = permute(&t, cfg.num_kv_heads);
        }
        let data: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        g.f32_tensor(&tensors::gguf_name(hf).unwrap(), t.dims(), &data);
    }
    g
}

#[test]
fn tiny_llama_and_qwen2_load_like_their_hf_weights() {
    for (arch, hf_arch, tied) in [
        ("llama", "LlamaForCausalLM", true),
        ("llama", "LlamaForCausalLM", false),
        ("qwen2", "Qwen2ForCausalLM", false),
    ] {
        let cfg = tiny_config(hf_arch, tied);
        let w = Weights::random(&cfg, 5, 0.5).unwrap();
        let file = parse(&tiny_gguf(arch, &cfg, &w)).unwrap();
        let got_cfg = config_from_gguf(&file).unwrap();
        assert_eq!(got_cfg, cfg, "{arch} config (tied {tied})");
        let opts = LoadOptions::default();
        let reference = Model::load(cfg.clone(), &w, &opts).unwrap();
        let model = load_model(&file, &opts).unwrap();
        let tokens = [1, 5, 9, 33, 2, 60, 7];
        let (a, b) = (
            reference.logits_for(&tokens).unwrap(),
            model.logits_for(&tokens).unwrap(),
        );
        assert_eq!(a, b, "{arch} logits (tied {tied})");
    }
}

#[test]
fn missing_or_unsupported_model_metadata_is_named() {
    let cfg = tiny_config("LlamaForCausalLM", true);
    let w = Weights::random(&cfg, 5, 0.5).unwrap();
    let good = tiny_gguf("llama", &cfg, &w);

    let mut g = good.clone();
    g.metadata.retain(|(k, _)| k != "llama.block_count");
    let e = config_from_gguf(&parse(&g).unwrap()).unwrap_err();
    assert!(
        matches!(&e, GgufError::MissingKey(k) if k == "llama.block_count"),
        "{e}"
    );

    let mut g = good.clone();
    g.metadata[0].1 = s("mamba");
    let e = config_from_gguf(&parse(&g).unwrap()).unwrap_err();
    assert!(
        matches!(&e, GgufError::UnsupportedArchitecture(a) if a == "mamba"),
        "{e}"
    );
    assert_eq!(e.error_type(), "gguf_unsupported");

    let mut g = good.clone();
    g.metadata
        .push(("llama.rope.scaling.type".into(), s("yarn")));
    let e = config_from_gguf(&parse(&g).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("llama.rope.scaling.type") && e.contains("yarn"),
        "{e}"
    );

    let mut g = good.clone();
    g.metadata
        .push(("llama.rope.scaling.type".into(), s("linear")));
    g.metadata
        .push(("llama.rope.scaling.factor".into(), Value::F32(4.0)));
    let c = config_from_gguf(&parse(&g).unwrap()).unwrap();
    assert_eq!(
        c.rope_scaling,
        crate::model::RopeScaling::Linear { factor: 4.0 }
    );

    // A tensor missing, or with other dimensions than the metadata says.
    let mut g = good.clone();
    g.tensors.retain(|t| t.name != "blk.1.ffn_up.weight");
    let e = load_model(&parse(&g).unwrap(), &LoadOptions::default())
        .err()
        .unwrap();
    assert!(
        matches!(&e, GgufError::MissingTensor(n) if n == "blk.1.ffn_up.weight"),
        "{e}"
    );
    let mut g = good.clone();
    let t = g
        .tensors
        .iter_mut()
        .find(|t| t.name == "blk.0.ffn_down.weight")
        .unwrap();
    t.dims.reverse();
    let e = load_model(&parse(&g).unwrap(), &LoadOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("blk.0.ffn_down.weight") && e.contains("dimensions"),
        "{e}"
    );
}

#[test]
fn llama3_rope_freqs_are_recognised() {
    let cfg = tiny_config("LlamaForCausalLM", true);
    let llama3 = crate::model::RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192.0,
    };
    let scaled = ModelConfig {
        rope_scaling: llama3,
        rope_theta: 500_000.0,
        ..cfg.clone()
    };
    let base = ModelConfig {
        rope_theta: 500_000.0,
        ..cfg.clone()
    }
    .rope_inv_freq();
    let divisors: Vec<f32> = base
        .iter()
        .zip(scaled.rope_inv_freq())
        .map(|(b, s)| (b / s) as f32)
        .collect();
    let w = Weights::random(&cfg, 5, 0.5).unwrap();
    let mut g = tiny_gguf("llama", &cfg, &w);
    g.metadata.retain(|(k, _)| k != "llama.rope.freq_base");
    g.kv("llama.rope.freq_base", Value::F32(500_000.0));
    g.f32_tensor("rope_freqs.weight", &[4], &divisors);
    let c = config_from_gguf(&parse(&g).unwrap()).unwrap();
    assert_eq!(c.rope_scaling, llama3);

    let mut bad = divisors.clone();
    bad[0] = 3.0;
    g.tensors.pop();
    g.f32_tensor("rope_freqs.weight", &[4], &bad);
    let e = config_from_gguf(&parse(&g).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("rope_freqs.weight"), "{e}");
}

#[test]
fn compute_dtype_f16_loads_too() {
    let cfg = tiny_config("LlamaForCausalLM", true);
    let w = Weights::random(&cfg, 5, 0.5).unwrap();
    let file = parse(&tiny_gguf("llama", &cfg, &w)).unwrap();
    let opts = LoadOptions {
        dtype: DType::F16,
        ..LoadOptions::default()
    };
    let model = load_model(&file, &opts).unwrap();
    assert_eq!(model.dtype(), DType::F16);
}
