//! The stories260k checkpoint of the reference files and its reference
//! outputs. Where the files are, and what an absent one does (a SKIP, or a
//! failure under `TANDEM_REQUIRE_REFERENCES=1`), is [`tandem::testing`]'s.

use std::path::PathBuf;

pub use tandem::testing::shared;

/// A JSON list of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an id list")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
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
    let list = reference["prompts"].as_array().expect("prompts");
    Some(Stories {
        prompts: list.iter().map(|p| ids(&p["prompt_ids"])).collect(),
        generated: list.iter().map(|p| ids(&p["generated_ids"])).collect(),
        dir,
    })
}

/// One SmolLM2 reference prompt: its name, kind (`plain` or `chat`), exact
/// text, chat messages (role, content), prompt ids and float32 greedy ids.
pub struct SmolPrompt {
    pub name: String,
    pub kind: String,
    pub text: String,
    pub messages: Vec<(String, String)>,
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
}

/// SmolLM2-135M-Instruct's Q4_1 GGUF and its reference prompts, or `None`
/// when `../shared` is absent.
pub fn smollm2() -> Option<(PathBuf, Vec<SmolPrompt>)> {
    let dir = shared("models/smollm2-135m-instruct")?;
    let text = std::fs::read_to_string(dir.join("reference.json")).expect("reference.json");
    let reference: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let prompts = reference["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| SmolPrompt {
            name: p["name"].as_str().expect("a name").to_string(),
            kind: p["kind"].as_str().expect("a kind").to_string(),
            text: p["text"].as_str().expect("a text").to_string(),
            messages: p["messages"]
                .as_array()
                .map(|m| {
                    m.iter()
                        .map(|m| {
                            let field =
                                |k: &str| m[k].as_str().expect("a message field").to_string();
                            (field("role"), field("content"))
                        })
                        .collect()
                })
                .unwrap_or_default(),
            prompt_ids: ids(&p["prompt_ids"]),
            generated_ids: ids(&p["generated_ids"]),
        })
        .collect();
    Some((dir.join("SmolLM2-135M-Instruct.Q4_1.gguf"), prompts))
}
