//! IncrementalDecoder: split multi-byte characters on byte-fallback and
//! byte-level tokenizers, payload alignment, lossy flushes.

use super::*;

#[test]
fn incremental_decoding_keeps_split_characters_whole_in_code_built_bpe() {
    let tok = fallback_bpe(true, false);
    let mut merged = 0;
    for text in MULTIBYTE {
        let ids = tok.encode_plain(text).unwrap();
        merged += check_incremental(&tok, &ids);
    }
    assert!(
        merged > 5,
        "byte-fallback characters must have been split ({merged})"
    );
}

#[test]
fn incremental_decoding_on_stories260k_byte_fallback() {
    let Some(tok) = load(STORIES) else { return };
    let mut merged = 0;
    for text in MULTIBYTE {
        let ids = tok.encode(text).unwrap();
        merged += check_incremental(&tok, &ids);
    }
    assert!(
        merged > 5,
        "byte-fallback characters must have been split ({merged})"
    );
}

#[test]
fn incremental_decoding_on_llama100m_byte_level() {
    let Some(tok) = load(LLAMA100M) else { return };
    let mut merged = 0;
    for text in MULTIBYTE {
        let ids = tok.encode(text).unwrap();
        merged += check_incremental(&tok, &ids);
    }
    assert!(
        merged > 3,
        "byte-level characters must have been split ({merged})"
    );
}

#[test]
fn finish_flushes_an_incomplete_character_lossily_with_its_payloads() {
    let tok = fallback_bpe(true, false);
    let byte = |b: u8| tok.inner().token_to_id(&format!("<0x{b:02X}>")).unwrap();
    let mut decoder = IncrementalDecoder::new(tok.clone());
    // "日" is E6 97 A5; send "a" then only two of its three bytes.
    assert_eq!(
        decoder.push(byte(b'a'), "a").unwrap(),
        Some(TextChunk {
            text: "a".into(),
            payloads: vec!["a"]
        })
    );
    assert_eq!(decoder.push(byte(0xE6), "e6").unwrap(), None);
    assert_eq!(decoder.push(byte(0x97), "97").unwrap(), None);
    assert_eq!(decoder.pending_tokens(), 2);
    let out_of_range = decoder.push(1_000_000, "bad");
    assert!(matches!(
        out_of_range,
        Err(TokenizerError::TokenIdOutOfRange { .. })
    ));
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
