//! The lean CPU step against the candle-op path (the reference), and the
//! agreement of f16 / Q8_0 / Q4_K greedy decoding with f32.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device};

use super::{
    ActivationQuant, Batch, LoadOptions, Model, ModelConfig, OutputRows, WeightFormat, Weights,
};
use crate::kv::KvCache;

fn config(arch: &str, window: Option<usize>, bias: bool, head_dim: usize) -> ModelConfig {
    let json = serde_json::json!({
        "architectures": [arch],
        "vocab_size": 97, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": head_dim,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "sliding_window": window, "attention_bias": bias,
    });
    ModelConfig::from_json(&json.to_string()).expect("valid config")
}

fn load(cfg: &ModelConfig, w: &Weights, dtype: DType, format: WeightFormat, lean: bool) -> Model {
    load_quantised(cfg, w, (dtype, format), lean, ActivationQuant::default())
}

fn load_quantised(
    cfg: &ModelConfig,
    w: &Weights,
    (dtype, format): (DType, WeightFormat),
    lean: bool,
    activation_quant: ActivationQuant,
) -> Model {
    let opts = LoadOptions {
        dtype,
        weight_format: format,
        lean_cpu: lean,
        activation_quant,
        // The cache in the compute dtype, so these comparisons see the
        // weights' formats alone (the f16 cache has its own test).
        kv_dtype: Some(dtype),
        ..LoadOptions::default()
    };
    Model::load(cfg.clone(), w, &opts).expect("model loads")
}

/// Logits of a ragged schedule: three sequences prefilled in chunks of
/// different sizes, then decoded together, some steps with several rows.
fn schedule_logits(model: &Model) -> Vec<Vec<f32>> {
    let mut kv = KvCache::new(model.kv_layout(), Device::Cpu, 1024);
    let prompts: Vec<Vec<u32>> = (0..3u32)
        .map(|s| {
            (0..11 + 7 * s)
                .map(|i| (s * 31 + i * 17 + 3) % 97)
                .collect()
        })
        .collect();
    for s in 0..3u32 {
        kv.allocate(s, 64).expect("room");
    }
    let mut out = Vec::new();
    let mut push_rows = |model: &Model, b: &Batch, kv: &mut KvCache| {
        let h = model.forward(b, kv).expect("forward");
        if h.dim(0).expect("rows") > 0 {
            let l = model.unembed(&h).expect("unembed");
            out.extend(l.to_vec2::<f32>().expect("logits"));
        }
    };
    // Chunked prefill, sequences at different offsets in one batch.
    let mut b = Batch::default();
    b.push(0, 0, &prompts[0][..5], OutputRows::None);
    b.push(1, 0, &prompts[1], OutputRows::Last);
    push_rows(model, &b, &mut kv);
    let mut b = Batch::default();
    b.push(0, 5, &prompts[0][5..], OutputRows::All);
    b.push(2, 0, &prompts[2], OutputRows::Last);
    push_rows(model, &b, &mut kv);
    for step in 0..6u32 {
        let mut b = Batch::default();
        for s in 0..3u32 {
            let len = kv.len(s).expect("slot");
            let n = if step == 2 && s == 1 { 3 } else { 1 };
            let toks: Vec<u32> = (0..n).map(|i| (step * 7 + s * 5 + i) % 97).collect();
            b.push(s, len, &toks, OutputRows::All);
        }
        push_rows(model, &b, &mut kv);
    }
    out
}

fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(b) {
        let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs() / scale);
        }
    }
    worst
}

/// What a pass reads per projection, as held: f32 at 4 bytes a weight,
/// Q8_0 at 34 bytes a block of 32 with rows padded to the repacked
/// records' 8, and Q4_K falling back to Q8_0 where widths are not
/// multiples of 256 (all of this config's).
#[test]
fn projection_bytes_count_each_projection_as_held() {
    let cfg = config("LlamaForCausalLM", None, false, 16);
    let w = Weights::random(&cfg, 13, 0.5).expect("weights");
    let shapes = [(128, 64), (64, 64), (192, 64), (64, 96), (97, 64)];
    let layers = |i: usize, v: usize| if i < 4 { 2 * v } else { v };
    let f32_bytes = |(n, k): (usize, usize)| 4 * n * k;
    let q8_bytes = |(n, k): (usize, usize)| n.next_multiple_of(8) * k / 32 * 34;
    for (format, bytes) in [
        (
            WeightFormat::AsCompute,
            &f32_bytes as &dyn Fn((usize, usize)) -> usize,
        ),
        (WeightFormat::Q8_0, &q8_bytes),
        (WeightFormat::Q4K, &q8_bytes),
    ] {
        let p = load(&cfg, &w, DType::F32, format, true).projection_bytes();
        let got = [p.qkv, p.o_proj, p.gate_up, p.down, p.lm_head];
        let want: Vec<usize> = shapes
            .iter()
            .enumerate()
            .map(|(i, &s)| layers(i, bytes(s)))
            .collect();
        assert_eq!(got.to_vec(), want, "{format:?}");
    }
}

#[test]
fn lean_f32_equals_candle_path() {
    for (arch, window, bias, hd) in [
        ("LlamaForCausalLM", None, false, 16),
        ("MistralForCausalLM", Some(6), false, 16),
        ("Qwen2ForCausalLM", None, true, 16),
        ("LlamaForCausalLM", None, false, 24),
    ] {
        let cfg = config(arch, window, bias, hd);
        let w = Weights::random(&cfg, 11, 0.5).expect("weights");
        let want = schedule_logits(&load(&cfg, &w, DType::F32, WeightFormat::AsCompute, false));
        let lean = load(&cfg, &w, DType::F32, WeightFormat::AsCompute, true);
        assert!(lean.is_lean());
        let got = schedule_logits(&lean);
        let d = max_rel_diff(&got, &want);
        assert!(
            d <= 1e-4,
            "{arch} window {window:?} hd {hd}: lean differs by {d:e}"
        );
    }
}

/// The lean path's KV cache is f16 by default under f32 compute, f32 when
/// asked: the logits move (the cache rounds K and V) but stay close to an
/// f32 cache's, and paths that cannot attend over f16 refuse it at load.
#[test]
fn lean_f16_kv_cache_stays_close_to_f32_and_other_paths_refuse_it() {
    let cfg = config("LlamaForCausalLM", None, false, 16);
    let w = Weights::random(&cfg, 12, 0.5).expect("weights");
    let with_kv = |kv_dtype, lean| {
        let opts = LoadOptions {
            lean_cpu: lean,
            kv_dtype,
            ..LoadOptions::default()
        };
        Model::load(cfg.clone(), &w, &opts)
    };
    let f32_cache = with_kv(Some(DType::F32), true).expect("model");
    let f16_cache = with_kv(None, true).expect("model");
    let candle = with_kv(None, false).expect("model");
    assert_eq!(candle.kv_layout().dtype, DType::F32, "the compute dtype");
    assert_eq!(f32_cache.kv_layout().dtype, DType::F32);
    assert_eq!(f16_cache.kv_layout().dtype, DType::F16);
    let d = max_rel_diff(&schedule_logits(&f16_cache), &schedule_logits(&f32_cache));
    assert!(d > 0.0, "an f16 cache must round K and V");
    assert!(d <= 5e-3, "f16 cache differs by {d:e}");
    for (kv_dtype, lean) in [(DType::F16, false), (DType::BF16, true)] {
        let err = with_kv(Some(kv_dtype), lean).err().expect("refused");
        assert!(err.to_string().contains("KV cache"), "{err}");
    }
}

#[test]
fn lean_rows_are_bit_identical_solo_batched_and_threaded() {
    // The kernels make a row's result independent of its batch and of the
    // thread count, so solo and batched decoding agree exactly, not just
    // within a tolerance.
    let cfg = config("LlamaForCausalLM", None, false, 16);
    let w = Weights::random(&cfg, 14, 0.5).expect("weights");
    let formats = [
        (DType::F32, WeightFormat::AsCompute),
        (DType::F16, WeightFormat::AsCompute),
        // Repacked Q8_0 (the default for 8-bit activations).
        (DType::F32, WeightFormat::Q8_0),
    ];
    for (dtype, weight_format) in formats {
        let mut logits = Vec::new();
        for threads in [Some(1), None] {
            let opts = LoadOptions {
                dtype,
                weight_format,
                threads,
                ..LoadOptions::default()
            };
            let model = Model::load(cfg.clone(), &w, &opts).expect("model");
            let prompts: Vec<Vec<u32>> = (0..5u32)
                .map(|s| (0..3 + 4 * s).map(|i| (s * 13 + i * 7 + 1) % 97).collect())
                .collect();
            let mut batched = Vec::new();
            let mut kv = KvCache::new(model.kv_layout(), Device::Cpu, 1024);
            let mut b = Batch::default();
            for (s, p) in prompts.iter().enumerate() {
                kv.allocate(s as u32, 64).expect("room");
                b.push(s as u32, 0, p, OutputRows::Last);
            }
            let h = model.forward(&b, &mut kv).expect("forward");
            batched.extend(
                model
                    .unembed(&h)
                    .expect("unembed")
                    .to_vec2::<f32>()
                    .expect("rows"),
            );
            for (s, p) in prompts.iter().enumerate() {
                let solo = model.logits_for(p).expect("solo");
                assert_eq!(
                    solo, batched[s],
                    "{dtype:?} {weight_format:?} threads {threads:?} seq {s}"
                );
            }
            logits.push(batched);
        }
        assert_eq!(
            logits[0], logits[1],
            "{dtype:?} {weight_format:?}: 1 thread vs all threads"
        );
    }
}

#[test]
fn lean_unembeds_zero_rows() {
    let cfg = config("LlamaForCausalLM", None, false, 16);
    let w = Weights::random(&cfg, 15, 0.5).expect("weights");
    for format in [WeightFormat::AsCompute, WeightFormat::Q8_0] {
        let model = load(&cfg, &w, DType::F32, format, true);
        let mut kv = KvCache::new(model.kv_layout(), Device::Cpu, 64);
        kv.allocate(0, 8).expect("room");
        let mut b = Batch::default();
        b.push(0, 0, &[1, 2, 3], OutputRows::None);
        let h = model.forward(&b, &mut kv).expect("forward");
        assert_eq!(h.dims(), &[0, 64]);
        assert_eq!(model.unembed(&h).expect("unembed").dims(), &[0, 97]);
    }
}

#[test]
fn lean_quantized_step_computes_its_dequantised_weights() {
    // The lean step multiplies Q8_0 blocks with quantised activations: it
    // must give what the candle step gives in f32 over the same weights
    // dequantised, up to that activation rounding (15-bit: ~1/128 of
    // 8-bit's).
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 97, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
    });
    let cfg = ModelConfig::from_json(&json.to_string()).expect("config");
    let w = Weights::random(&cfg, 12, 0.5).expect("weights");
    let Weights::Memory(tensors) = &w else {
        panic!("random weights live in memory")
    };
    let dequantised = tensors
        .iter()
        .map(|(name, t)| {
            let projection = name.contains("proj") || name.contains("lm_head");
            let t = if projection {
                let q = QTensor::quantize(t, GgmlDType::Q8_0).expect("quantise");
                q.dequantize(&Device::Cpu).expect("dequantise")
            } else {
                t.clone()
            };
            (name.clone(), t)
        })
        .collect();
    let dequantised = Weights::Memory(dequantised);
    let want = schedule_logits(&load(
        &cfg,
        &dequantised,
        DType::F32,
        WeightFormat::AsCompute,
        false,
    ));
    for (quant, tol) in [
        (ActivationQuant::Int16, 1e-3),
        (ActivationQuant::Int8, 2e-2),
    ] {
        let model = load_quantised(&cfg, &w, (DType::F32, WeightFormat::Q8_0), true, quant);
        let d = max_rel_diff(&schedule_logits(&model), &want);
        eprintln!("{quant:?}: lean Q8_0 against its dequantised weights in f32: {d:e}");
        assert!(
            d <= tol,
            "lean Q8_0 ({quant:?}) differs from its dequantised weights in f32 by {d:e}"
        );
    }
}

#[test]
fn lean_f16_and_q8_stay_close_to_f32() {
    let cfg = config("LlamaForCausalLM", None, false, 16);
    let w = Weights::random(&cfg, 13, 0.5).expect("weights");
    let f32_logits = schedule_logits(&load(&cfg, &w, DType::F32, WeightFormat::AsCompute, true));
    for (dtype, format, tol) in [
        (DType::F16, WeightFormat::AsCompute, 2e-2),
        (DType::F32, WeightFormat::Q8_0, 5e-2),
    ] {
        let got = schedule_logits(&load(&cfg, &w, dtype, format, true));
        let d = max_rel_diff(&got, &f32_logits);
        eprintln!("{dtype:?}/{format:?}: max relative logit difference to f32 {d:e}");
        assert!(d <= tol, "{dtype:?}/{format:?} differs from f32 by {d:e}");
    }
}

/// Fraction of positions where two continuations agree.
pub(crate) fn agreement(a: &[Vec<u32>], b: &[Vec<u32>]) -> f64 {
    let (mut same, mut total) = (0usize, 0usize);
    for (x, y) in a.iter().zip(b) {
        same += x.iter().zip(y).filter(|(p, q)| p == q).count();
        total += x.len();
    }
    same as f64 / total.max(1) as f64
}

#[test]
fn stories260k_greedy_agreement_with_f32() {
    let Some(dir) = crate::testing::shared("models/stories260k") else {
        return;
    };
    let dir = dir.as_path();
    let cfg = ModelConfig::from_dir(dir).expect("config");
    let w = Weights::from_dir(dir).expect("weights");
    let reference: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("reference.json")).expect("reference.json"),
    )
    .expect("json");
    // One id list per prompt entry, under `key`.
    let list = |key: &str| -> Vec<Vec<u32>> {
        reference["prompts"]
            .as_array()
            .expect("prompts")
            .iter()
            .map(|p| {
                p[key]
                    .as_array()
                    .expect("ids")
                    .iter()
                    .map(|x| x.as_u64().expect("id") as u32)
                    .collect()
            })
            .collect()
    };
    let prompts = list("prompt_ids");
    let f32_ids = load(&cfg, &w, DType::F32, WeightFormat::AsCompute, true)
        .greedy(&prompts, 64)
        .expect("greedy");
    let expected = list("generated_ids");
    assert_eq!(f32_ids, expected, "lean f32 reproduces the reference ids");
    for (dtype, format, floor) in [
        (DType::F16, WeightFormat::AsCompute, 0.9),
        (DType::F32, WeightFormat::Q8_0, 0.5),
        (DType::F32, WeightFormat::Q4K, 0.2),
    ] {
        let ids = load(&cfg, &w, dtype, format, true)
            .greedy(&prompts, 64)
            .expect("greedy");
        let a = agreement(&ids, &f32_ids);
        eprintln!(
            "stories260k {dtype:?}/{format:?}: greedy agreement with f32 {:.3}",
            a
        );
        assert!(
            a >= floor,
            "{dtype:?}/{format:?} agreement {a} below {floor}"
        );
    }
}

#[test]
fn repacked_q8_0_computes_what_the_ggml_layout_does() {
    // The same integer sums, added per block instead of per lane: the
    // logits agree to f32 rounding, and repacking happens only where the
    // lean path multiplies with 8-bit activations.
    let cfg = config("LlamaForCausalLM", None, false, 16);
    let w = Weights::random(&cfg, 16, 0.5).expect("weights");
    let load_with = |repack_quantised: bool, activation_quant: ActivationQuant| {
        let opts = LoadOptions {
            weight_format: WeightFormat::Q8_0,
            repack_quantised,
            activation_quant,
            ..LoadOptions::default()
        };
        Model::load(cfg.clone(), &w, &opts).expect("model")
    };
    let packed = load_with(true, ActivationQuant::Int8);
    let flat = load_with(false, ActivationQuant::Int8);
    assert!(packed.loaded_weights().layers[0].down.is_packed());
    assert!(!flat.loaded_weights().layers[0].down.is_packed());
    assert!(!load_with(true, ActivationQuant::Int16)
        .loaded_weights()
        .layers[0]
        .down
        .is_packed());
    let (got, want) = (schedule_logits(&packed), schedule_logits(&flat));
    let d = max_rel_diff(&got, &want);
    assert!(d <= 1e-4, "repacked Q8_0 differs by {d:e}");
    assert!(packed.quantized_projections());
    // The candle path and the head's shared tensors read repacked weights
    // through their unpacked blocks.
    for (p, f) in [
        (
            &packed.loaded_weights().layers[0].down,
            &flat.loaded_weights().layers[0].down,
        ),
        (
            &packed.loaded_weights().lm_head,
            &flat.loaded_weights().lm_head,
        ),
    ] {
        let k = f.dense().expect("dense").dims2().expect("2-D").1;
        let x = candle_core::Tensor::rand(-1f32, 1f32, (3, k), &Device::Cpu).expect("x");
        assert_eq!(
            p.forward(&x)
                .expect("candle")
                .to_vec2::<f32>()
                .expect("rows"),
            f.forward(&x)
                .expect("candle")
                .to_vec2::<f32>()
                .expect("rows")
        );
        assert_eq!(
            p.dense().expect("dense").to_vec2::<f32>().expect("rows"),
            f.dense().expect("dense").to_vec2::<f32>().expect("rows")
        );
    }
}
