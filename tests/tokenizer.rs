//! Tokenizer layer: loading and encoding real model folders, incremental
//! decoding across split multi-byte characters, stop strings, and the
//! generated word-level vocabulary.
//!
//! Tests that read the reference files (`../shared` next to the crate, see
//! [`tandem::testing`]) print `SKIP:` and pass when they are absent, unless
//! `TANDEM_REQUIRE_REFERENCES=1`; the rest build tokenizers in code.

#[path = "tokenizer/incremental.rs"]
mod incremental;
#[path = "tokenizer/stream.rs"]
mod stream;
#[path = "tokenizer/vocab.rs"]
mod vocab;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use proptest::prelude::*;
use serde_json::{json, Value};
use tandem::tokenizer::word_vocab::{self, BOS_ID, EOS_ID, UNK_ID};
use tandem::tokenizer::{
    word_level_tokenizer, IncrementalDecoder, StopFilter, StopMatch, TextChunk, TextStream,
    Tokenizer, TokenizerError,
};

/// Model folders of the reference files, relative to their root.
const STORIES: &str = "models/stories260k";
const LLAMA100M: &str = "bench/llama-100m";

/// Texts whose characters need 2, 3 and 4 UTF-8 bytes.
const MULTIBYTE: &[&str] = &[
    "café naïve façade",
    "日本語のテキスト 鬱",
    "emoji 🎉🦀 and 👩‍👩‍👧 family",
    "mixed: ñ ß 漢字 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done",
];

/// The tokenizer of a reference model folder, or `None` after a SKIP.
fn load(dir: &str) -> Option<Arc<Tokenizer>> {
    let dir = tandem::testing::shared(dir)?;
    Some(Arc::new(
        Tokenizer::from_dir(&dir).expect("shared tokenizer loads"),
    ))
}

/// stories260k's `reference.json` (llama2.c outputs for three prompts).
/// Call it after [`load`] found the folder.
fn stories_reference() -> Value {
    let path = tandem::testing::shared_root()
        .join(STORIES)
        .join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The `key` id list of a `reference.json` prompt entry.
fn reference_ids(prompt: &Value, key: &str) -> Vec<u32> {
    let list = prompt[key].as_array().unwrap();
    list.iter()
        .map(|v| u32::try_from(v.as_u64().unwrap()).unwrap())
        .collect()
}

/// A fresh, empty scratch folder for one test.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tandem-tok-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write_json(dir: &Path, name: &str, value: &Value) {
    std::fs::write(dir.join(name), serde_json::to_string_pretty(value).unwrap()).unwrap();
}

/// A SentencePiece-style BPE with byte fallback (like stories260k's), built
/// in code: `<unk> <s> </s>`, the 256 byte tokens, then a few pieces and
/// merges. `é` is a piece of its own; CJK and emoji fall back to bytes.
fn fallback_bpe_json(bos_post_processor: bool) -> Value {
    let mut vocab = serde_json::Map::new();
    for t in ["<unk>", "<s>", "</s>"] {
        vocab.insert(t.into(), json!(vocab.len()));
    }
    for b in 0..=255u8 {
        vocab.insert(format!("<0x{b:02X}>"), json!(vocab.len()));
    }
    let letters = ('a'..='z').map(String::from);
    let pieces = ["▁", "é", "▁t", "he", "▁the", "▁c", "af", "▁caf"];
    for p in letters.chain(pieces.iter().map(|p| p.to_string())) {
        let id = vocab.len();
        vocab.entry(p).or_insert(json!(id));
    }
    let merges = json!([
        ["▁", "t"],
        ["h", "e"],
        ["▁t", "he"],
        ["▁", "c"],
        ["a", "f"],
        ["▁c", "af"]
    ]);
    let post = if bos_post_processor {
        json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}},
        })
    } else {
        Value::Null
    };
    let added: Vec<Value> = ["<unk>", "<s>", "</s>"]
        .iter()
        .enumerate()
        .map(|(id, c)| json!({"id": id, "content": c, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        ]},
        "pre_tokenizer": null,
        "post_processor": post,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ]},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null,
            "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    })
}

fn fallback_bpe(bos_post_processor: bool, add_bos: bool) -> Arc<Tokenizer> {
    let inner: tokenizers::Tokenizer =
        serde_json::from_value(fallback_bpe_json(bos_post_processor)).unwrap();
    Arc::new(Tokenizer::from_parts(inner, Some(1), vec![2], add_bos).unwrap())
}

/// Pushes `ids` (payload = position) and returns the chunks, finish included.
fn stream_chunks(
    tok: &Arc<Tokenizer>,
    context: &[u32],
    ids: &[u32],
) -> Vec<(TextChunk<usize>, usize)> {
    let mut decoder = IncrementalDecoder::with_context(tok.clone(), context).unwrap();
    let mut chunks = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        if let Some(chunk) = decoder.push(id, i).unwrap() {
            chunks.push((chunk, i + 1));
        }
    }
    chunks.extend(decoder.finish().map(|c| (c, ids.len())));
    chunks
}

/// The invariants of incremental decoding for a valid-UTF-8 text's ids:
/// chunks concatenate to the full decode, contain no U+FFFD, carry every
/// payload once in order, and each chunk's text is exactly what its tokens
/// add to the decoded prefix. Returns how many chunks merged several tokens.
fn check_incremental(tok: &Arc<Tokenizer>, ids: &[u32]) -> usize {
    let chunks = stream_chunks(tok, &[], ids);
    let full = tok.decode(ids).unwrap();
    let joined: String = chunks.iter().map(|(c, _)| c.text.as_str()).collect();
    assert_eq!(joined, full, "chunks must concatenate to the full decode");
    let payloads: Vec<usize> = chunks
        .iter()
        .flat_map(|(c, _)| c.payloads.clone())
        .collect();
    assert_eq!(payloads, (0..ids.len()).collect::<Vec<_>>());
    let mut start = 0;
    let mut merged = 0;
    for (chunk, end) in &chunks {
        assert!(
            !chunk.text.contains('\u{FFFD}'),
            "{:?} holds U+FFFD",
            chunk.text
        );
        assert_eq!(chunk.payloads, (start..*end).collect::<Vec<_>>());
        let before = tok.decode(&ids[..start]).unwrap();
        let after = tok.decode(&ids[..*end]).unwrap();
        assert_eq!(chunk.text, after[before.len()..], "tokens {start}..{end}");
        merged += usize::from(end - start > 1);
        start = *end;
    }
    merged
}

// ---------------------------------------------------------------- Tokenizer

#[test]
fn stories260k_reproduces_the_reference_prompts_and_texts() {
    let Some(tok) = load(STORIES) else { return };
    assert_eq!(tok.vocab_size(), 512);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2]);
    assert!(tok.is_eos(2) && !tok.is_eos(1));
    let reference = stories_reference();
    let prompts = reference["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 3);
    for p in prompts {
        let text = p["text"].as_str().unwrap();
        let prompt = reference_ids(p, "prompt_ids");
        let generated = reference_ids(p, "generated_ids");
        assert_eq!(tok.encode(text).unwrap(), prompt, "prompt {text:?}");
        assert_eq!(tok.encode_plain(text).unwrap(), prompt[1..]);
        // A literal BOS in the text is not doubled.
        assert_eq!(tok.encode(&format!("<s>{text}")).unwrap(), prompt);

        let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        assert_eq!(
            tok.decode(&all).unwrap(),
            p["runc_output_text"].as_str().unwrap()
        );
        // Decoded on their own, the generated ids lose the leading space
        // (SentencePiece strips it from the first token); decoded after the
        // prompt they give run.c's text exactly.
        let gen_text = p["generated_text"].as_str().unwrap();
        let own = tok.decode(&generated).unwrap();
        assert_eq!(own, gen_text.strip_prefix(' ').unwrap_or(gen_text));
        let streamed: String = stream_chunks(&tok, &prompt, &generated)
            .iter()
            .map(|(c, _)| c.text.as_str())
            .collect();
        assert_eq!(streamed, gen_text);
    }
}

#[test]
fn llama100m_adds_bos_once_and_round_trips() {
    let Some(tok) = load(LLAMA100M) else { return };
    assert_eq!(tok.vocab_size(), 32_000);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2]);
    assert_eq!(tok.chat_template(), None);
    for text in ["Hello world", "  leading spaces", "<s>already there"]
        .iter()
        .chain(MULTIBYTE)
    {
        let ids = tok.encode(text).unwrap();
        assert_eq!(ids[0], 1, "{text:?}");
        assert_eq!(
            ids.iter().filter(|&&id| id == 1).count(),
            1,
            "{text:?}: {ids:?}"
        );
        let expected = text.strip_prefix("<s>").unwrap_or(text);
        let plain = tok.encode_plain(expected).unwrap();
        assert_eq!(ids[1..], plain, "{text:?}");
        assert_eq!(tok.decode(&ids).unwrap(), expected);
    }
    // Byte-level pieces carry their own spaces: token texts concatenate.
    let ids = tok.encode_plain("Hello big world").unwrap();
    let texts: Vec<String> = ids.iter().map(|&id| tok.token_text(id).unwrap()).collect();
    assert_eq!(texts.concat(), "Hello big world");
    assert!(
        texts.iter().filter(|t| t.starts_with(' ')).count() >= 2,
        "{texts:?}"
    );
    assert_eq!(tok.token_text(2).unwrap(), "</s>");
    assert!(matches!(
        tok.token_text(32_000),
        Err(TokenizerError::TokenIdOutOfRange {
            id: 32_000,
            vocab_size: 32_000,
            ..
        })
    ));
}

#[test]
fn token_text_keeps_sentencepiece_leading_spaces() {
    let tok = fallback_bpe(true, false);
    let the = tok.inner().token_to_id("▁the").unwrap();
    assert_eq!(tok.token_text(the).unwrap(), " the");
    assert_eq!(
        tok.decode(&[the]).unwrap(),
        "the",
        "a full decode strips it"
    );
    let byte_a = tok.inner().token_to_id("<0x61>").unwrap();
    assert_eq!(tok.token_text(byte_a).unwrap(), "a");
    let half = tok.inner().token_to_id("<0xE6>").unwrap();
    assert_eq!(tok.token_text(half).unwrap(), "\u{FFFD}");
}

#[test]
fn bos_comes_from_the_post_processor_or_from_add_bos_never_twice() {
    let by_post = fallback_bpe(true, true);
    let by_config = fallback_bpe(false, true);
    let none = fallback_bpe(false, false);
    let the = by_post.encode_plain("the cat").unwrap();
    let with_bos: Vec<u32> = std::iter::once(1).chain(the.iter().copied()).collect();
    assert_eq!(by_post.encode("the cat").unwrap(), with_bos);
    assert_eq!(by_config.encode("the cat").unwrap(), with_bos);
    assert_eq!(none.encode("the cat").unwrap(), the);
    assert_eq!(by_config.encode("<s>the cat").unwrap(), with_bos);
    assert_eq!(by_post.encode("<s>the cat").unwrap(), with_bos);
}

#[test]
fn from_parts_rejects_ids_outside_the_vocabulary() {
    let inner: tokenizers::Tokenizer = serde_json::from_value(fallback_bpe_json(false)).unwrap();
    let size = Tokenizer::from_parts(inner.clone(), None, vec![], false)
        .unwrap()
        .vocab_size();
    let err =
        Tokenizer::from_parts(inner.clone(), Some(1), vec![2, size as u32], false).unwrap_err();
    assert!(matches!(err, TokenizerError::TokenIdOutOfRange { id, .. } if id as usize == size));
    let tok = Tokenizer::from_parts(inner, Some(1), vec![2, 2, 0, 2], false).unwrap();
    assert_eq!(tok.eos_ids(), &[2, 0]);
    assert!(matches!(
        tok.decode(&[5, 99_999]),
        Err(TokenizerError::TokenIdOutOfRange { id: 99_999, .. })
    ));
}

#[test]
fn from_dir_unions_eos_ids_and_reads_added_token_objects() {
    let dir = scratch_dir("union");
    write_json(&dir, "tokenizer.json", &fallback_bpe_json(false));
    write_json(
        &dir,
        "tokenizer_config.json",
        &json!({
            "add_bos_token": true,
            "bos_token": {"content": "<s>", "special": true},
            "eos_token": "</s>",
            "chat_template": "{{ bos_token }}{{ messages }}",
        }),
    );
    write_json(
        &dir,
        "generation_config.json",
        &json!({"eos_token_id": [2, 7, 5]}),
    );
    write_json(
        &dir,
        "config.json",
        &json!({"eos_token_id": 9, "bos_token_id": 1}),
    );
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_ids(), &[2, 7, 5, 9]);
    assert_eq!(tok.chat_template(), Some("{{ bos_token }}{{ messages }}"));
    // No post-processor: add_bos_token supplies the BOS.
    assert_eq!(tok.encode("the").unwrap()[0], 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn from_dir_errors_name_the_file_and_the_problem() {
    let dir = scratch_dir("errors");
    let message = |dir: &Path| Tokenizer::from_dir(dir).unwrap_err().to_string();

    let msg = message(&dir);
    assert!(
        msg.contains("tokenizer.json") && msg.contains("cannot read"),
        "{msg}"
    );

    std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
    let msg = message(&dir);
    assert!(
        msg.contains("tokenizer.json") && msg.contains("invalid JSON"),
        "{msg}"
    );

    write_json(
        &dir,
        "tokenizer.json",
        &json!({"version": "1.0", "model": {"type": "Nope"}}),
    );
    assert!(matches!(
        Tokenizer::from_dir(&dir),
        Err(TokenizerError::Load { .. })
    ));

    write_json(&dir, "tokenizer.json", &fallback_bpe_json(true));
    write_json(
        &dir,
        "tokenizer_config.json",
        &json!({"eos_token": "<|end|>"}),
    );
    let msg = message(&dir);
    assert!(
        msg.contains("tokenizer_config.json")
            && msg.contains("eos_token")
            && msg.contains("<|end|>"),
        "{msg}"
    );

    write_json(
        &dir,
        "tokenizer_config.json",
        &json!({"add_bos_token": "yes"}),
    );
    let msg = message(&dir);
    assert!(msg.contains("add_bos_token"), "{msg}");

    std::fs::remove_file(dir.join("tokenizer_config.json")).unwrap();
    std::fs::write(dir.join("generation_config.json"), "[1,").unwrap();
    let msg = message(&dir);
    assert!(
        msg.contains("generation_config.json") && msg.contains("invalid JSON"),
        "{msg}"
    );

    write_json(
        &dir,
        "generation_config.json",
        &json!({"eos_token_id": [2, "x"]}),
    );
    let msg = message(&dir);
    assert!(
        msg.contains("generation_config.json") && msg.contains("eos_token_id"),
        "{msg}"
    );

    write_json(&dir, "generation_config.json", &json!({}));
    write_json(&dir, "config.json", &json!({"eos_token_id": 1_000_000}));
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(
        matches!(err, TokenizerError::TokenIdOutOfRange { id: 1_000_000, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("config.json"));
    std::fs::remove_dir_all(&dir).unwrap();
}
