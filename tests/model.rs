//! Foundation tests: ragged batched forward, chunked prefill, speculation,
//! the stories260k reference, and loading errors.

mod support;

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use support::ragged::{assert_commit_equals_feeding_accepted, prompt, ragged_vs_solo};
use support::reference::{shared, stories260k, Stories};
use tandem::kv::KvCache;
use tandem::model::{Batch, LoadOptions, Model, ModelConfig, ModelError, OutputRows, Weights};

/// A small random GQA model (2 KV heads shared by 4 query heads).
fn small_model(sliding_window: Option<usize>) -> Model {
    let json = serde_json::json!({
        "architectures": [if sliding_window.is_some() { "MistralForCausalLM" } else { "LlamaForCausalLM" }],
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": false, "sliding_window": sliding_window,
    });
    let cfg = ModelConfig::from_json(&json.to_string()).unwrap();
    let w = Weights::random(&cfg, 7, 0.5).unwrap();
    Model::load(cfg, &w, &LoadOptions::default()).unwrap()
}

fn kv_for(model: &Model, cap: usize) -> KvCache {
    KvCache::new(model.kv_layout(), Device::Cpu, cap)
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2().unwrap()
}

#[test]
fn batched_equals_solo_for_ragged_sequences() {
    for window in [None, Some(5)] {
        let model = small_model(window);
        // (history already in cache, tokens this step, output rows)
        let shapes = [
            (0, 7, OutputRows::Last),
            (3, 1, OutputRows::Last),
            (10, 4, OutputRows::All),
            (1, 1, OutputRows::All),
            (0, 12, OutputRows::All),
            (6, 2, OutputRows::Last),
            (20, 3, OutputRows::Last),
        ];
        let mut batched_kv = kv_for(&model, 4096);
        let (_, got, solo) =
            ragged_vs_solo(&model, &shapes, &mut batched_kv, || kv_for(&model, 4096));
        assert_eq!(got.len(), solo.len());
        for (g, s) in got.iter().zip(&solo) {
            assert!(
                max_abs_diff(g, s) <= 1e-4,
                "window {window:?}: batched differs from solo by {}",
                max_abs_diff(g, s)
            );
        }
    }
}

#[test]
fn chunked_prefill_equals_one_shot() {
    let model = small_model(None);
    let toks = prompt(5, 40, 97);
    let mut one = kv_for(&model, 64);
    one.allocate(1, 64).unwrap();
    let mut b = Batch::default();
    b.push(1, 0, &toks, OutputRows::Last);
    let want = rows(
        &model
            .unembed(&model.forward(&b, &mut one).unwrap())
            .unwrap(),
    );

    let mut chunked = kv_for(&model, 64);
    chunked.allocate(1, 64).unwrap();
    let mut got = Vec::new();
    for (start, end) in [(0, 13), (13, 14), (14, 31), (31, 40)] {
        let mut b = Batch::default();
        b.push(
            1,
            start,
            &toks[start..end],
            if end == 40 {
                OutputRows::Last
            } else {
                OutputRows::None
            },
        );
        got = rows(
            &model
                .unembed(&model.forward(&b, &mut chunked).unwrap())
                .unwrap(),
        );
    }
    assert!(max_abs_diff(&got[0], &want[0]) <= 1e-4);
    // Same cache: one more decode step agrees too.
    for kv in [&mut one, &mut chunked] {
        assert_eq!(kv.len(1).unwrap(), 40);
    }
    let step = |kv: &mut KvCache| {
        let mut b = Batch::default();
        b.push(1, 40, &[9], OutputRows::Last);
        rows(&model.unembed(&model.forward(&b, kv).unwrap()).unwrap()).remove(0)
    };
    assert!(max_abs_diff(&step(&mut one), &step(&mut chunked)) <= 1e-4);
}

#[test]
fn speculation_commit_equals_feeding_only_accepted() {
    let model = small_model(None);
    let toks = prompt(2, 10, 97);
    let drafts = [11u32, 12, 13, 14];
    for accepted in 0..=drafts.len() {
        let mut kv = kv_for(&model, 128);
        kv.allocate(3, 64).unwrap();
        let mut b = Batch::default();
        b.push(3, 0, &toks, OutputRows::Last);
        model.forward(&b, &mut kv).unwrap();
        kv.begin(3).unwrap();
        let mut b = Batch::default();
        b.push(3, 10, &drafts, OutputRows::All);
        model.forward(&b, &mut kv).unwrap();
        kv.commit(3, accepted).unwrap();
        assert_eq!(kv.len(3).unwrap(), 10 + accepted);

        let reference = kv_for(&model, 128);
        assert_commit_equals_feeding_accepted(&model, &mut kv, reference, &toks, &drafts, accepted);
    }
}

#[test]
fn kv_capacity_accounting_returns_to_start() {
    let model = small_model(None);
    let mut kv = kv_for(&model, 100);
    assert_eq!(kv.available_tokens(), 100);
    kv.allocate(1, 60).unwrap();
    let err = kv.allocate(2, 50).unwrap_err();
    assert!(
        matches!(
            err,
            tandem::kv::KvError::Exhausted {
                requested: 50,
                available: 40,
                ..
            }
        ),
        "{err}"
    );
    kv.allocate(2, 40).unwrap();
    assert_eq!(kv.available_tokens(), 0);
    let mut b = Batch::default();
    b.push(1, 0, &prompt(1, 61, 97), OutputRows::Last);
    let err = model.forward(&b, &mut kv).unwrap_err();
    assert!(err.to_string().contains("reserved 60"), "{err}");
    assert!(kv.free(1) && kv.free(2) && !kv.free(2));
    assert_eq!(kv.available_tokens(), 100);
    assert_eq!(kv.reserved_tokens(), 0);
}

#[test]
fn bad_batches_are_errors_not_panics() {
    let model = small_model(None);
    let mut kv = kv_for(&model, 100);
    kv.allocate(1, 50).unwrap();
    let cases: Vec<(Batch, &str)> = vec![
        (
            Batch {
                tokens: vec![1, 2],
                seqs: vec![tandem::model::SeqSpan {
                    slot: 1,
                    offset: 0,
                    len: 3,
                    output: OutputRows::Last,
                }],
            },
            "spans cover",
        ),
        (
            Batch {
                tokens: vec![1],
                seqs: vec![tandem::model::SeqSpan {
                    slot: 1,
                    offset: 4,
                    len: 1,
                    output: OutputRows::Last,
                }],
            },
            "starts at position",
        ),
        (
            Batch {
                tokens: vec![1],
                seqs: vec![tandem::model::SeqSpan {
                    slot: 9,
                    offset: 0,
                    len: 1,
                    output: OutputRows::Last,
                }],
            },
            "no KV allocation",
        ),
        (
            Batch {
                tokens: vec![500],
                seqs: vec![tandem::model::SeqSpan {
                    slot: 1,
                    offset: 0,
                    len: 1,
                    output: OutputRows::Last,
                }],
            },
            "outside the vocabulary",
        ),
        (Batch::default(), "empty batch"),
    ];
    for (b, msg) in cases {
        let err = model.forward(&b, &mut kv).unwrap_err();
        assert!(err.to_string().contains(msg), "expected `{msg}` in `{err}`");
    }
    assert_eq!(
        kv.len(1).unwrap(),
        0,
        "a failed forward must not advance the cache"
    );
}

#[test]
fn stories260k_reproduces_reference_greedy_ids() {
    let Some(Stories {
        dir,
        prompts,
        generated: expected,
    }) = stories260k()
    else {
        return;
    };
    let model = Model::from_dir(&dir, &LoadOptions::default()).unwrap();
    assert!(prompts.len() >= 3);
    for (p, want) in prompts.iter().zip(&expected) {
        let got = model.greedy(std::slice::from_ref(p), want.len()).unwrap();
        assert_eq!(&got[0], want, "solo decode of prompt {p:?}");
    }
    let got = model.greedy(&prompts, 64).unwrap();
    assert_eq!(got, expected, "all prompts in one batch");
}

fn copy_model_dir(tag: &str) -> Option<PathBuf> {
    let src = shared("models/stories260k")?;
    let dst = std::env::temp_dir().join(format!("tandem-load-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    Some(dst)
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

#[test]
fn loading_errors_name_the_problem() {
    let Some(dir) = copy_model_dir("errors") else {
        return;
    };
    let load = |d: &Path| {
        Model::from_dir(d, &LoadOptions::default())
            .err()
            .expect("load must fail")
    };

    edit_config(&dir, |v| {
        v["architectures"] = serde_json::json!(["GPT2LMHeadModel"])
    });
    let e = load(&dir);
    assert!(
        matches!(e, ModelError::UnsupportedArchitecture(ref a) if a == "GPT2LMHeadModel"),
        "{e}"
    );

    edit_config(&dir, |v| {
        v["architectures"] = serde_json::json!(["LlamaForCausalLM"]);
        v["intermediate_size"] = serde_json::json!(100);
    });
    let e = load(&dir);
    assert!(
        matches!(e, ModelError::ShapeMismatch { ref name, .. } if name == "model.layers.0.mlp.gate_proj.weight"),
        "{e}"
    );
    assert!(e.to_string().contains("model.safetensors"), "{e}");

    edit_config(&dir, |v| {
        v["intermediate_size"] = serde_json::json!(172);
        v["num_hidden_layers"] = serde_json::json!(6);
    });
    let e = load(&dir);
    assert!(
        matches!(e, ModelError::MissingTensor { ref name, .. } if name == "model.layers.5.self_attn.q_proj.weight"),
        "{e}"
    );

    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    let e = load(&dir);
    assert!(
        matches!(e, ModelError::Config { .. }) && e.to_string().contains("config.json"),
        "{e}"
    );

    std::fs::write(
        dir.join("config.json"),
        r#"{"architectures":["LlamaForCausalLM"],"vocab_size":512}"#,
    )
    .unwrap();
    let e = load(&dir);
    assert!(e.to_string().contains("hidden_size"), "{e}");

    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::copy(
        shared("models/stories260k").unwrap().join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    std::fs::write(dir.join("model.safetensors"), b"garbage").unwrap();
    let e = load(&dir);
    assert!(
        matches!(e, ModelError::Weights { .. }) && e.to_string().contains("model.safetensors"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sharded_checkpoints_load() {
    let Some(dir) = copy_model_dir("sharded") else {
        return;
    };
    let tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let (mut a, mut b) = (
        std::collections::HashMap::new(),
        std::collections::HashMap::new(),
    );
    let mut map = serde_json::Map::new();
    for (i, (name, t)) in tensors.into_iter().enumerate() {
        let file = if i % 2 == 0 {
            "model-00001-of-00002.safetensors"
        } else {
            "model-00002-of-00002.safetensors"
        };
        map.insert(name.clone(), file.into());
        if i % 2 == 0 {
            a.insert(name, t)
        } else {
            b.insert(name, t)
        };
    }
    candle_core::safetensors::save(&a, dir.join("model-00001-of-00002.safetensors")).unwrap();
    candle_core::safetensors::save(&b, dir.join("model-00002-of-00002.safetensors")).unwrap();
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::json!({"weight_map": map}).to_string(),
    )
    .unwrap();
    let sharded = Model::from_dir(&dir, &LoadOptions::default()).unwrap();
    let single = Model::from_dir(
        &shared("models/stories260k").unwrap(),
        &LoadOptions::default(),
    )
    .unwrap();
    let p = [1u32, 403, 407, 261, 378];
    assert_eq!(
        sharded.logits_for(&p).unwrap(),
        single.logits_for(&p).unwrap()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn config_variants_parse() {
    let base = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 64,
    });
    // transformers 4: rope_theta + rope_scaling (llama3).
    let mut v4 = base.clone();
    v4["rope_theta"] = 500000.0.into();
    v4["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let c4 = ModelConfig::from_json(&v4.to_string()).unwrap();
    // transformers 5: the same under rope_parameters.
    let mut v5 = base.clone();
    v5["rope_parameters"] = serde_json::json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let c5 = ModelConfig::from_json(&v5.to_string()).unwrap();
    assert_eq!(c4, c5);
    assert_eq!(c4.rope_theta, 500000.0);
    let plain = ModelConfig::from_json(
        &{
            let mut v = base.clone();
            v["rope_theta"] = 500000.0.into();
            v
        }
        .to_string(),
    )
    .unwrap();
    let (scaled, unscaled) = (c4.rope_inv_freq(), plain.rope_inv_freq());
    assert_eq!(
        scaled[0], unscaled[0],
        "high frequencies are untouched by llama3 scaling"
    );
    assert!(scaled[1] < unscaled[1], "low frequencies are divided");
    let mut q = base.clone();
    q["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
    let cq = ModelConfig::from_json(&q.to_string()).unwrap();
    assert!(cq.attention_bias);
    let mut bad = base.clone();
    bad["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    assert!(ModelConfig::from_json(&bad.to_string())
        .unwrap_err()
        .to_string()
        .contains("yarn"));
    let mut eos = base.clone();
    eos["eos_token_id"] = serde_json::json!([2, 7]);
    assert_eq!(
        ModelConfig::from_json(&eos.to_string())
            .unwrap()
            .eos_token_ids,
        vec![2, 7]
    );
}

#[test]
fn qwen2_biases_are_loaded_and_used() {
    let json = serde_json::json!({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 50, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64,
    });
    let cfg = ModelConfig::from_json(&json.to_string()).unwrap();
    let w = Weights::random(&cfg, 1, 0.5).unwrap();
    assert!(w.contains("model.layers.0.self_attn.k_proj.bias"));
    let m = Model::load(cfg.clone(), &w, &LoadOptions::default()).unwrap();
    let Weights::Memory(mut map) = w else {
        unreachable!()
    };
    map.insert(
        "model.layers.0.self_attn.q_proj.bias".into(),
        (Tensor::arange(0f32, 16f32, &Device::Cpu).unwrap() * 0.5).unwrap(),
    );
    let m0 = Model::load(cfg, &Weights::Memory(map), &LoadOptions::default()).unwrap();
    let (a, b) = (
        m.logits_for(&[1, 2, 3]).unwrap(),
        m0.logits_for(&[1, 2, 3]).unwrap(),
    );
    assert!(max_abs_diff(&a, &b) > 1e-4, "q bias must change the logits");
    assert!(a.iter().all(|x| x.is_finite()));
}
