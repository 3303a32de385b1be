//! Tokenizer layer: loading and encoding real model folders, incremental
//! decoding across split multi-byte characters, stop strings, and the
//! generated word-level vocabulary.
//!
//! Tests that read `/work/shared` (as `../shared` next to the crate) print
//! `SKIP:` and pass when it is absent; the rest build tokenizers in code.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use proptest::prelude::*;
use serde_json::{json, Value};
use tandem::tokenizer::word_vocab::{self, BOS_ID, EOS_ID, UNK_ID};
use tandem::tokenizer::{
    word_level_tokenizer, IncrementalDecoder, StopFilter, StopMatch, TextChunk, TextStream,
    Tokenizer, TokenizerError,
};

const STORIES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/models/stories260k");
const LLAMA100M: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/bench/llama-100m");

/// Texts whose characters need 2, 3 and 4 UTF-8 bytes.
const MULTIBYTE: &[&str] = &[
    "café naïve façade",
    "日本語のテキスト 鬱",
    "emoji 🎉🦀 and 👩‍👩‍👧 family",
    "mixed: ñ ß 漢字 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done",
];

fn shared_dir(dir: &str) -> Option<&Path> {
    let path = Path::new(dir);
    if path.is_dir() {
        Some(path)
    } else {
        eprintln!("SKIP: {dir} is absent");
        None
    }
}

fn load(dir: &str) -> Option<Arc<Tokenizer>> {
    let dir = shared_dir(dir)?;
    Some(Arc::new(Tokenizer::from_dir(dir).expect("shared tokenizer loads")))
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
    let merges = json!([["▁", "t"], ["h", "e"], ["▁t", "he"], ["▁", "c"], ["a", "f"], ["▁c", "af"]]);
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
    let payloads: Vec<usize> = chunks.iter().flat_map(|(c, _)| c.payloads.clone()).collect();
    assert_eq!(payloads, (0..ids.len()).collect::<Vec<_>>());
    let mut start = 0;
    let mut merged = 0;
    for (chunk, end) in &chunks {
        assert!(!chunk.text.contains('\u{FFFD}'), "{:?} holds U+FFFD", chunk.text);
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
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(STORIES).join("reference.json")).unwrap())
            .unwrap();
    let prompts = reference["prompts"].as_array().unwrap();
    assert_eq!(prompts.len(), 3);
    for p in prompts {
        let ids = |key: &str| -> Vec<u32> {
            p[key].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
        };
        let text = p["text"].as_str().unwrap();
        let (prompt, generated) = (ids("prompt_ids"), ids("generated_ids"));
        assert_eq!(tok.encode(text).unwrap(), prompt, "prompt {text:?}");
        assert_eq!(tok.encode_plain(text).unwrap(), prompt[1..]);
        // A literal BOS in the text is not doubled.
        assert_eq!(tok.encode(&format!("<s>{text}")).unwrap(), prompt);

        let all: Vec<u32> = prompt.iter().chain(&generated).copied().collect();
        assert_eq!(tok.decode(&all).unwrap(), p["runc_output_text"].as_str().unwrap());
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
        assert_eq!(ids.iter().filter(|&&id| id == 1).count(), 1, "{text:?}: {ids:?}");
        let expected = text.strip_prefix("<s>").unwrap_or(text);
        let plain = tok.encode_plain(expected).unwrap();
        assert_eq!(ids[1..], plain, "{text:?}");
        assert_eq!(tok.decode(&ids).unwrap(), expected);
    }
    let world = tok.encode_plain("Hello world").unwrap();
    assert_eq!(tok.token_text(*world.last().unwrap()).unwrap(), " world");
    assert_eq!(tok.token_text(2).unwrap(), "</s>");
    assert!(matches!(
        tok.token_text(32_000),
        Err(TokenizerError::TokenIdOutOfRange { id: 32_000, vocab_size: 32_000, .. })
    ));
}

#[test]
fn token_text_keeps_sentencepiece_leading_spaces() {
    let tok = fallback_bpe(true, false);
    let the = tok.inner().token_to_id("▁the").unwrap();
    assert_eq!(tok.token_text(the).unwrap(), " the");
    assert_eq!(tok.decode(&[the]).unwrap(), "the", "a full decode strips it");
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
    let size = Tokenizer::from_parts(inner.clone(), None, vec![], false).unwrap().vocab_size();
    let err = Tokenizer::from_parts(inner.clone(), Some(1), vec![2, size as u32], false).unwrap_err();
    assert!(matches!(err, TokenizerError::TokenIdOutOfRange { id, .. } if id as usize == size));
    let tok = Tokenizer::from_parts(inner, Some(1), vec![2, 2, 0, 2], false).unwrap();
    assert_eq!(tok.eos_ids(), &[2, 0]);
    assert!(matches!(tok.decode(&[5, 99_999]), Err(TokenizerError::TokenIdOutOfRange { id: 99_999, .. })));
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
    write_json(&dir, "generation_config.json", &json!({"eos_token_id": [2, 7, 5]}));
    write_json(&dir, "config.json", &json!({"eos_token_id": 9, "bos_token_id": 1}));
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
    assert!(msg.contains("tokenizer.json") && msg.contains("cannot read"), "{msg}");

    std::fs::write(dir.join("tokenizer.json"), "{ not json").unwrap();
    let msg = message(&dir);
    assert!(msg.contains("tokenizer.json") && msg.contains("invalid JSON"), "{msg}");

    write_json(&dir, "tokenizer.json", &json!({"version": "1.0", "model": {"type": "Nope"}}));
    assert!(matches!(Tokenizer::from_dir(&dir), Err(TokenizerError::Load { .. })));

    write_json(&dir, "tokenizer.json", &fallback_bpe_json(true));
    write_json(&dir, "tokenizer_config.json", &json!({"eos_token": "<|end|>"}));
    let msg = message(&dir);
    assert!(msg.contains("tokenizer_config.json") && msg.contains("eos_token") && msg.contains("<|end|>"), "{msg}");

    write_json(&dir, "tokenizer_config.json", &json!({"add_bos_token": "yes"}));
    let msg = message(&dir);
    assert!(msg.contains("add_bos_token"), "{msg}");

    std::fs::remove_file(dir.join("tokenizer_config.json")).unwrap();
    std::fs::write(dir.join("generation_config.json"), "[1,").unwrap();
    let msg = message(&dir);
    assert!(msg.contains("generation_config.json") && msg.contains("invalid JSON"), "{msg}");

    write_json(&dir, "generation_config.json", &json!({"eos_token_id": [2, "x"]}));
    let msg = message(&dir);
    assert!(msg.contains("generation_config.json") && msg.contains("eos_token_id"), "{msg}");

    write_json(&dir, "generation_config.json", &json!({}));
    write_json(&dir, "config.json", &json!({"eos_token_id": 1_000_000}));
    let err = Tokenizer::from_dir(&dir).unwrap_err();
    assert!(matches!(err, TokenizerError::TokenIdOutOfRange { id: 1_000_000, .. }), "{err}");
    assert!(err.to_string().contains("config.json"));
    std::fs::remove_dir_all(&dir).unwrap();
}

// ------------------------------------------------------ IncrementalDecoder

#[test]
fn incremental_decoding_keeps_split_characters_whole_in_code_built_bpe() {
    let tok = fallback_bpe(true, false);
    let mut merged = 0;
    for text in MULTIBYTE {
        let ids = tok.encode_plain(text).unwrap();
        merged += check_incremental(&tok, &ids);
    }
    assert!(merged > 5, "byte-fallback characters must have been split ({merged})");
}

#[test]
fn incremental_decoding_on_stories260k_byte_fallback() {
    let Some(tok) = load(STORIES) else { return };
    let mut merged = 0;
    for text in MULTIBYTE {
        let ids = tok.encode(text).unwrap();
        merged += check_incremental(&tok, &ids);
    }
    assert!(merged > 5, "byte-fallback characters must have been split ({merged})");
}

#[test]
fn incremental_decoding_on_llama100m_byte_level() {
    let Some(tok) = load(LLAMA100M) else { return };
    let mut merged = 0;
    for text in MULTIBYTE {
        let ids = tok.encode(text).unwrap();
        merged += check_incremental(&tok, &ids);
    }
    assert!(merged > 3, "byte-level characters must have been split ({merged})");
}

#[test]
fn finish_flushes_an_incomplete_character_lossily_with_its_payloads() {
    let tok = fallback_bpe(true, false);
    let byte = |b: u8| tok.inner().token_to_id(&format!("<0x{b:02X}>")).unwrap();
    let mut decoder = IncrementalDecoder::new(tok.clone());
    // "日" is E6 97 A5; send "a" then only two of its three bytes.
    assert_eq!(
        decoder.push(byte(b'a'), "a").unwrap(),
        Some(TextChunk { text: "a".into(), payloads: vec!["a"] })
    );
    assert_eq!(decoder.push(byte(0xE6), "e6").unwrap(), None);
    assert_eq!(decoder.push(byte(0x97), "97").unwrap(), None);
    assert_eq!(decoder.pending_tokens(), 2);
    let out_of_range = decoder.push(1_000_000, "bad");
    assert!(matches!(out_of_range, Err(TokenizerError::TokenIdOutOfRange { .. })));
    let chunk = decoder.finish().unwrap();
    assert_eq!(chunk.payloads, vec!["e6", "97"]);
    assert!(chunk.text.starts_with('\u{FFFD}') && chunk.text.chars().all(|c| c == '\u{FFFD}'));
    assert_eq!(decoder.finish(), None);
}

#[test]
fn a_long_run_without_a_character_is_flushed_not_held_forever() {
    let tok = fallback_bpe(true, false);
    let lone = tok.inner().token_to_id("<0xE6>").unwrap();
    let mut decoder = IncrementalDecoder::new(tok);
    let mut flushed = Vec::new();
    for i in 0..40 {
        if let Some(chunk) = decoder.push(lone, i).unwrap() {
            flushed.extend(chunk.payloads);
        }
    }
    assert_eq!(flushed, (0..32).collect::<Vec<_>>());
    assert_eq!(decoder.pending_tokens(), 8);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn incremental_decoding_equals_full_decoding(text in "\\PC{0,24}") {
        prop_assume!(!text.contains('\u{FFFD}'));
        let tok = fallback_bpe(true, false);
        let ids = tok.encode_plain(&text).unwrap();
        check_incremental(&tok, &ids);
        let words = word_level_tokenizer(300, 3).unwrap();
        let words = Arc::new(words);
        let ids = words.encode(&text).unwrap();
        check_incremental(&words, &ids);
    }
}

// ------------------------------------------------------- StopFilter / TextStream

/// Streams `chunks` through a filter; returns (emitted text, emitted
/// payloads, the stop match).
fn run_filter(stops: &[&str], chunks: &[&str]) -> (String, Vec<usize>, Option<StopMatch>) {
    let mut filter = StopFilter::new(stops.iter().map(|s| s.to_string()).collect()).unwrap();
    let (mut text, mut payloads, mut stop) = (String::new(), Vec::new(), None);
    let mut steps: Vec<_> = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| filter.push(TextChunk { text: c.to_string(), payloads: vec![i] }))
        .collect();
    steps.push(filter.finish());
    for step in steps {
        for chunk in step.chunks {
            assert!(!chunk.text.is_empty() || !chunk.payloads.is_empty());
            text.push_str(&chunk.text);
            payloads.extend(chunk.payloads);
        }
        if step.stop.is_some() {
            assert!(stop.is_none(), "a stream stops once");
            stop = step.stop;
        }
    }
    (text, payloads, stop)
}

/// Where a stream over `text` must stop: the match that ends first, ties to
/// the earliest start, then list order.
fn expected_cut(text: &str, stops: &[&str]) -> Option<(usize, usize)> {
    stops
        .iter()
        .enumerate()
        .filter_map(|(i, s)| text.find(s).map(|start| (start + s.len(), start, i)))
        .min()
        .map(|(_, start, i)| (start, i))
}

#[test]
fn stop_strings_spanning_chunks_stop_exactly_and_never_leak() {
    let (text, payloads, stop) = run_filter(&["b c"], &["a", " b", " c", " d"]);
    assert_eq!(text, "a ");
    assert_eq!(payloads, vec![0, 1], "` b` starts before the match; ` c` inside it");
    assert_eq!(stop, Some(StopMatch { index: 0, stop: "b c".into() }));

    let mut filter = StopFilter::new(vec!["STOP".into()]).unwrap();
    let mut sent = String::new();
    for piece in ["ok S", "T", "O"] {
        sent.push_str(&filter.push(TextChunk { text: piece.into(), payloads: vec![()] }).text());
        assert_eq!(sent, "ok ", "no prefix of STOP may leak");
    }
    let step = filter.push(TextChunk { text: "P and more".into(), payloads: vec![()] });
    assert!(step.chunks.is_empty());
    assert_eq!(step.stop.unwrap().stop, "STOP");
}

#[test]
fn held_back_partial_matches_are_released_when_they_do_not_match() {
    let mut filter = StopFilter::new(vec!["</answer>".into()]).unwrap();
    let step = filter.push(TextChunk { text: "x </ans".into(), payloads: vec![0] });
    assert_eq!(step.text(), "x ");
    assert_eq!(filter.held_text(), "</ans");
    let step = filter.push(TextChunk { text: "wer".into(), payloads: vec![1] });
    assert!(step.chunks.is_empty());
    let step = filter.push(TextChunk { text: "s>".into(), payloads: vec![2] });
    assert_eq!(step.text(), "</answers>");
    assert_eq!(step.chunks.iter().map(|c| c.payloads.clone()).collect::<Vec<_>>(), vec![vec![], vec![1], vec![2]]);
    // Held text is released by finish.
    filter.push(TextChunk { text: " </an".into(), payloads: vec![3] });
    let step = filter.finish();
    assert_eq!(step.text(), "</an");
    assert_eq!(step.stop, None);
}

#[test]
fn the_match_that_completes_first_wins() {
    let (text, _, stop) = run_filter(&["box", "big"], &["a big", " box"]);
    assert_eq!((text.as_str(), stop.unwrap().index), ("a ", 1));
    // "bc" completes before "abcd" does, however the text is chunked.
    for chunks in [&["abcd"][..], &["ab", "cd"], &["a", "b", "c", "d"]] {
        let (text, _, stop) = run_filter(&["abcd", "bc"], chunks);
        assert_eq!((text.as_str(), stop.unwrap().index), ("a", 1), "{chunks:?}");
    }
    // Same end: the earlier start (longer string) cuts more.
    let (text, _, stop) = run_filter(&["c", "b c"], &["a b c"]);
    assert_eq!((text.as_str(), stop.unwrap().index), ("a ", 1));
}

#[test]
fn empty_stop_strings_are_rejected() {
    let tok = Arc::new(word_level_tokenizer(100, 1).unwrap());
    let err = TextStream::<()>::new(tok, vec!["ok".into(), String::new()]).unwrap_err();
    assert!(matches!(err, TokenizerError::EmptyStopString { index: 1 }));
    assert!(err.to_string().contains("stop[1]"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn stop_filter_output_does_not_depend_on_chunking(
        text in "[ab c]{0,24}",
        stops in prop::collection::vec("[ab c]{1,4}", 0..3),
        cuts in prop::collection::vec(0usize..25, 0..8),
    ) {
        let mut cuts: Vec<usize> = cuts.into_iter().filter(|&c| c <= text.len()).collect();
        cuts.push(0);
        cuts.push(text.len());
        cuts.sort_unstable();
        cuts.dedup();
        let chunks: Vec<&str> = cuts.windows(2).map(|w| &text[w[0]..w[1]]).collect();
        let stop_refs: Vec<&str> = stops.iter().map(String::as_str).collect();
        let (out, payloads, stop) = run_filter(&stop_refs, &chunks);
        match expected_cut(&text, &stop_refs) {
            Some((cut, index)) => {
                prop_assert_eq!(&out, &text[..cut]);
                prop_assert_eq!(stop.map(|s| s.index), Some(index));
                // Exactly the chunks that start before the match are paid out.
                let starts: Vec<usize> = (0..chunks.len()).filter(|&i| cuts[i] < cut).collect();
                prop_assert_eq!(payloads, starts);
            }
            None => {
                prop_assert_eq!(&out, &text);
                prop_assert_eq!(stop, None);
                prop_assert_eq!(payloads, (0..chunks.len()).collect::<Vec<_>>());
            }
        }
    }
}

/// Streams `ids` through a TextStream with prompt `context`; returns the
/// text, the payloads and the stop match.
fn run_stream(
    tok: &Arc<Tokenizer>,
    stops: &[&str],
    context: &[u32],
    ids: &[u32],
) -> (String, Vec<usize>, Option<StopMatch>) {
    let stops = stops.iter().map(|s| s.to_string()).collect();
    let mut stream = TextStream::with_context(tok.clone(), stops, context).unwrap();
    let (mut text, mut payloads) = (String::new(), Vec::new());
    let mut steps = Vec::new();
    for (i, &id) in ids.iter().enumerate() {
        steps.push(stream.push(id, i).unwrap());
    }
    steps.push(stream.finish());
    for step in &steps {
        for chunk in &step.chunks {
            text.push_str(&chunk.text);
            payloads.extend(chunk.payloads.iter().copied());
        }
    }
    (text, payloads, stream.stop_match().cloned())
}

#[test]
fn text_stream_on_stories260k_stops_at_every_substring_exactly() {
    let Some(tok) = load(STORIES) else { return };
    let prompt = tok.encode("Once upon a time").unwrap();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(Path::new(STORIES).join("reference.json")).unwrap())
            .unwrap();
    let generated: Vec<u32> = reference["prompts"][0]["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let full = reference["prompts"][0]["generated_text"].as_str().unwrap();

    let (text, payloads, stop) = run_stream(&tok, &[], &prompt, &generated);
    assert_eq!((text.as_str(), stop), (full, None));
    assert_eq!(payloads, (0..generated.len()).collect::<Vec<_>>());

    // Every substring of length 1..=7 starting at a character boundary.
    let mut checked = 0;
    for (start, _) in full.char_indices() {
        for len in 1..=7 {
            let Some(stop) = full.get(start..start + len) else { continue };
            let cut = full.find(stop).unwrap();
            let (text, payloads, matched) = run_stream(&tok, &[stop], &prompt, &generated);
            assert_eq!(text, full[..cut], "stop {stop:?}");
            assert_eq!(matched.map(|m| m.stop), Some(stop.to_owned()));
            assert!(payloads.windows(2).all(|w| w[1] == w[0] + 1) && payloads.first().is_none_or(|&p| p == 0));
            checked += 1;
        }
    }
    assert!(checked > 500, "{checked}");
    eprintln!("checked {checked} stop strings");

    // "Lily's mom said" ends the text: "said." is held to the end, then
    // released by finish.
    let (text, _, stop) = run_stream(&tok, &["said."], &prompt, &generated);
    assert_eq!((text.as_str(), stop), (full, None));
}

#[test]
fn text_stream_over_word_vocab_with_payload_alignment() {
    let tok = Arc::new(word_level_tokenizer(500, 11).unwrap());
    let word = |id: u32| tok.inner().id_to_token(id).unwrap();
    let ids: Vec<u32> = vec![20, 21, 3, 22, 23, 24, 4, 25];
    let full = tok.decode(&ids).unwrap();
    assert_eq!(
        full,
        format!("{} {}. {} {} {}, {}", word(20), word(21), word(22), word(23), word(24), word(25))
    );
    let stop = format!("{} {}", word(23), word(24));
    let (text, payloads, matched) = run_stream(&tok, &[&stop], &[], &ids);
    let cut = full.find(&stop).unwrap();
    assert_eq!(text, full[..cut]);
    // Token 4's text (" word23") starts with the space before the match, so
    // its payload goes out with that space; token 5 (" word24") starts inside
    // the match and is dropped with everything after it.
    assert_eq!(payloads, vec![0, 1, 2, 3, 4]);
    assert_eq!(matched.unwrap().index, 0);
}

// ------------------------------------------------------------ word vocab

#[test]
fn word_vocab_is_deterministic_and_exactly_sized() {
    for &(size, seed) in &[(word_vocab::MIN_VOCAB_SIZE, 0), (512, 0), (4096, 42), (32_000, 7)] {
        let a = word_level_tokenizer(size, seed).unwrap();
        let b = word_level_tokenizer(size, seed).unwrap();
        assert_eq!(a.vocab_size(), size);
        assert_eq!(a.inner().get_vocab_size(true), size, "no holes, no duplicates");
        assert_eq!(a.inner().get_vocab(true), b.inner().get_vocab(true));
        assert_eq!(a.bos_id(), Some(BOS_ID));
        assert_eq!(a.eos_ids(), &[EOS_ID]);
    }
    let a = word_level_tokenizer(512, 1).unwrap();
    let b = word_level_tokenizer(512, 2).unwrap();
    assert_ne!(a.inner().id_to_token(100), b.inner().id_to_token(100));
    // A smaller vocabulary with the same seed is a prefix of a larger one.
    let big = word_level_tokenizer(4096, 1).unwrap();
    for id in 0..512 {
        assert_eq!(a.inner().id_to_token(id), big.inner().id_to_token(id));
    }
    for bad in [0, word_vocab::MIN_VOCAB_SIZE - 1, word_vocab::MAX_VOCAB_SIZE + 1] {
        assert!(matches!(word_level_tokenizer(bad, 0), Err(TokenizerError::VocabSize { .. })));
    }
}

#[test]
fn word_vocab_layout_and_round_trip() {
    let tok = word_level_tokenizer(1000, 5).unwrap();
    let inner = tok.inner();
    assert_eq!(inner.id_to_token(UNK_ID).as_deref(), Some("<unk>"));
    assert_eq!(inner.id_to_token(BOS_ID).as_deref(), Some("<s>"));
    assert_eq!(inner.id_to_token(EOS_ID).as_deref(), Some("</s>"));
    for (i, p) in word_vocab::PUNCTUATION.iter().enumerate() {
        assert_eq!(inner.token_to_id(p), Some(3 + i as u32));
    }
    let words: Vec<String> = (word_vocab::FIXED_TOKENS as u32..1000)
        .map(|id| inner.id_to_token(id).unwrap())
        .collect();
    assert!(words.iter().all(|w| (2..=13).contains(&w.len()) && w.chars().all(|c| c.is_ascii_lowercase())));

    let text = format!("{} {}, {}! {}?", words[0], words[1], words[2], words[3]);
    let ids = tok.encode(&text).unwrap();
    assert_eq!(ids.len(), 8);
    assert_eq!(ids[0], BOS_ID);
    assert_eq!(tok.decode(&ids).unwrap(), text);
    // Upper case is folded; unknown words become <unk>, which decodes to nothing.
    let shout = tok.encode(&format!("{} Zzzzqx", words[0].to_uppercase())).unwrap();
    assert_eq!(shout, vec![BOS_ID, word_vocab::FIXED_TOKENS as u32, UNK_ID]);
    assert_eq!(tok.token_text(ids[2]).unwrap(), format!(" {}", words[1]));
    assert_eq!(tok.token_text(4).unwrap(), ",");
}
