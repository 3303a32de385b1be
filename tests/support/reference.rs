//! The stories260k checkpoint of `../shared` and its reference outputs.

use std::path::{Path, PathBuf};

/// A path under `../shared`, or `None` (with a visible SKIP line) when the
/// folder is absent, as on a fresh machine.
pub fn shared(rel: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../shared")
        .join(rel);
    if p.exists() {
        Some(p)
    } else {
        eprintln!("SKIP: {} is absent", p.display());
        None
    }
}

/// stories260k's directory with its reference prompts and greedy
/// continuations (token ids, from a trusted reference implementation).
pub struct Stories {
    pub dir: PathBuf,
    pub prompts: Vec<Vec<u32>>,
    pub generated: Vec<Vec<u32>>,
}

/// Loads stories260k's `reference.json`, or `None` when `../shared` is absent.
pub fn stories260k() -> Option<Stories> {
    let dir = shared("models/stories260k")?;
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let reference: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array()
            .expect("an id list")
            .iter()
            .map(|x| x.as_u64().expect("an id") as u32)
            .collect()
    };
    let list = reference["prompts"].as_array().expect("prompts");
    Some(Stories {
        prompts: list.iter().map(|p| ids(&p["prompt_ids"])).collect(),
        generated: list.iter().map(|p| ids(&p["generated_ids"])).collect(),
        dir,
    })
}
