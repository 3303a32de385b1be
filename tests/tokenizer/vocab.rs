//! The generated word-level vocabulary of the embedded default model.

use super::*;

#[test]
fn word_vocab_is_deterministic_and_exactly_sized() {
    for &(size, seed) in &[
        (word_vocab::MIN_VOCAB_SIZE, 0),
        (512, 0),
        (4096, 42),
        (32_000, 7),
    ] {
        let a = word_level_tokenizer(size, seed).unwrap();
        let b = word_level_tokenizer(size, seed).unwrap();
        assert_eq!(a.vocab_size(), size);
        assert_eq!(
            a.inner().get_vocab_size(true),
            size,
            "no holes, no duplicates"
        );
        assert_eq!(a.inner().get_vocab(true), b.inner().get_vocab(true));
        assert_eq!(a.bos_id(), Some(BOS_ID));
        assert_eq!(a.eos_ids(), &[EOS_ID]);
    }
    let a = word_level_tokenizer(512, 1).unwrap();
    let b = word_level_tokenizer(512, 2).unwrap();
    let a_word = word_vocab::FIXED_TOKENS as u32 + 100;
    assert_ne!(a.inner().id_to_token(a_word), b.inner().id_to_token(a_word));
    // A smaller vocabulary with the same seed is a prefix of a larger one.
    let big = word_level_tokenizer(4096, 1).unwrap();
    for id in 0..512 {
        assert_eq!(a.inner().id_to_token(id), big.inner().id_to_token(id));
    }
    for bad in [
        0,
        word_vocab::MIN_VOCAB_SIZE - 1,
        word_vocab::MAX_VOCAB_SIZE + 1,
    ] {
        assert!(matches!(
            word_level_tokenizer(bad, 0),
            Err(TokenizerError::VocabSize { .. })
        ));
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
    assert!(words
        .iter()
        .all(|w| (2..=13).contains(&w.len()) && w.chars().all(|c| c.is_ascii_lowercase())));

    let text = format!("{} {}, {}! {}?", words[0], words[1], words[2], words[3]);
    let ids = tok.encode(&text).unwrap();
    assert_eq!(ids.len(), 8);
    assert_eq!(ids[0], BOS_ID);
    assert_eq!(tok.decode(&ids).unwrap(), text);
    // Upper case is folded; unknown words become <unk>, which decodes to nothing.
    let shout = tok
        .encode(&format!("{} Zzzzqx", words[0].to_uppercase()))
        .unwrap();
    assert_eq!(shout, vec![BOS_ID, word_vocab::FIXED_TOKENS as u32, UNK_ID]);
    assert_eq!(tok.token_text(ids[2]).unwrap(), format!(" {}", words[1]));
    assert_eq!(tok.token_text(4).unwrap(), ",");
}

#[test]
fn word_vocab_words_are_pinned() {
    // Golden values: the embedded model's text depends on them, so a change
    // of RNG or syllable tables must be deliberate.
    let tok = word_level_tokenizer(4096, 0).unwrap();
    let first = word_vocab::FIXED_TOKENS as u32;
    let words: Vec<String> = (first..first + 6)
        .map(|id| tok.inner().id_to_token(id).unwrap())
        .collect();
    assert_eq!(
        words,
        ["muker", "loli", "tilepe", "pobrosohu", "flizet", "chulachu"]
    );
    assert_eq!(
        tok.decode(&[first, first + 1, 4, first + 2, 3]).unwrap(),
        "muker loli, tilepe."
    );
}
