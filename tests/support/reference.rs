//! The stories260k checkpoint of the reference files and its reference
//! outputs. Where the files are, and what an absent one does (a SKIP, or a
//! failure under `TANDEM_REQUIRE_REFERENCES=1`), is [`tandem::testing`]'s.

use std::path::PathBuf;

pub use tandem::testing::shared;

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
