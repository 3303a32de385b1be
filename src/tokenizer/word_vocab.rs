//! The embedded default model's vocabulary: pseudo-English words, built in
//! code.
//!
//! The default model ships without files, so its tokenizer is generated: a
//! word-level vocabulary whose words are strung together from syllables by a
//! seeded ChaCha8 RNG. Random model output then reads as random words
//! ("bamo telisa, rune.") instead of byte soup, which makes demos and logs
//! legible.
//!
//! Layout of the ids (fixed, whatever the size):
//! - 0 `<unk>` (every out-of-vocabulary word), 1 `<s>` (BOS, added by the
//!   post-processor), 2 `</s>` (EOS); all three are special tokens, skipped
//!   when decoding.
//! - 3.. the punctuation marks of [`PUNCTUATION`], in that order.
//! - then one *glue* token per character of [`glue_chars`] (tab, newline,
//!   then printable ASCII `' '..='~'` in byte order), spelled `##c`: it decodes to `c` with no space before it,
//!   so constrained output (JSON, a regex, tool calls) can spell any ASCII
//!   text, keys and digits included, on a vocabulary of words. Nothing
//!   encodes to a glue token (the pre-tokenizer splits `#`); only
//!   generation produces them.
//! - then `vocab_size - FIXED_TOKENS` unique lowercase words, in generation
//!   order.
//!
//! Text pipeline: lowercase normaliser; split on whitespace, then isolate
//! each punctuation mark; word-level lookup. Decoding joins tokens with one
//! space and removes the space before punctuation, so
//! `decode(encode("bamo, telisa."))` is `"bamo, telisa."` when both words
//! are in the vocabulary.
//!
//! Determinism: the words depend only on `(vocab_size, seed)` (ChaCha8's
//! stream is specified, and only its raw `u32` output is used, never a
//! version-dependent sampling routine).

use std::collections::HashSet;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Map, Value};

use super::{Tokenizer, TokenizerError};

/// Id of `<unk>`.
pub const UNK_ID: u32 = 0;
/// Id of `<s>`, the BOS token.
pub const BOS_ID: u32 = 1;
/// Id of `</s>`, the EOS token.
pub const EOS_ID: u32 = 2;
/// The special tokens, in id order.
pub const SPECIAL_TOKENS: [&str; 3] = ["<unk>", "<s>", "</s>"];
/// Punctuation tokens, ids 3.. in this order. Each attaches to the word
/// before it when decoding.
pub const PUNCTUATION: [&str; 6] = [".", ",", "!", "?", ";", ":"];
/// Id of the first glue token; see [`glue_id`].
pub const FIRST_GLUE: u32 = (SPECIAL_TOKENS.len() + PUNCTUATION.len()) as u32;
/// The glue tokens: tab, newline, then every printable ASCII byte.
pub const GLUE_TOKENS: usize = 2 + (b'~' - b' ' + 1) as usize;

/// The characters of the glue tokens, in id order.
pub fn glue_chars() -> impl Iterator<Item = u8> {
    [b'\t', b'\n'].into_iter().chain(b' '..=b'~')
}

/// The id of the glue token that decodes to `c`, if there is one.
pub fn glue_id(c: u8) -> Option<u32> {
    glue_chars()
        .position(|g| g == c)
        .map(|i| FIRST_GLUE + i as u32)
}
/// Ids before the first word.
pub const FIXED_TOKENS: usize = SPECIAL_TOKENS.len() + PUNCTUATION.len() + GLUE_TOKENS;
/// Smallest accepted `vocab_size` (the fixed tokens and one word).
pub const MIN_VOCAB_SIZE: usize = FIXED_TOKENS + 1;
/// Largest accepted `vocab_size`. Far below the number of distinct words the
/// syllable tables allow, so generation never runs short of new words.
pub const MAX_VOCAB_SIZE: usize = 1 << 20;

const ONSETS: [&str; 27] = [
    "b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z", "br", "ch",
    "cl", "dr", "fl", "gr", "pl", "sh", "st", "th", "tr",
];
const VOWELS: [&str; 5] = ["a", "e", "i", "o", "u"];
const CODAS: [&str; 7] = ["n", "r", "s", "l", "m", "t", "k"];

/// Builds the deterministic word-level tokenizer of the embedded default
/// model: exactly `vocab_size` ids (see the module docs for their layout),
/// the same tokenizer for the same `(vocab_size, seed)`.
///
/// Fails with [`TokenizerError::VocabSize`] outside
/// [`MIN_VOCAB_SIZE`]`..=`[`MAX_VOCAB_SIZE`].
pub fn word_level_tokenizer(vocab_size: usize, seed: u64) -> Result<Tokenizer, TokenizerError> {
    if !(MIN_VOCAB_SIZE..=MAX_VOCAB_SIZE).contains(&vocab_size) {
        return Err(TokenizerError::VocabSize {
            requested: vocab_size,
            min: MIN_VOCAB_SIZE,
            max: MAX_VOCAB_SIZE,
        });
    }
    let words = generate_words(vocab_size - FIXED_TOKENS, seed)?;
    let json = tokenizer_json(&words);
    let inner: tokenizers::Tokenizer =
        serde_json::from_value(json).map_err(|e| TokenizerError::Build(e.to_string()))?;
    let tokenizer = Tokenizer::from_parts(inner, Some(BOS_ID), vec![EOS_ID], true)?;
    if tokenizer.vocab_size() != vocab_size {
        return Err(TokenizerError::Build(format!(
            "generated vocabulary has {} ids, expected {vocab_size}",
            tokenizer.vocab_size()
        )));
    }
    Ok(tokenizer)
}

/// `count` unique words, in a deterministic order for `seed`.
fn generate_words(count: usize, seed: u64) -> Result<Vec<String>, TokenizerError> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut seen = HashSet::with_capacity(count);
    let mut words = Vec::with_capacity(count);
    // Collisions are rare except among short words; the bound only guards
    // against an endless loop should the tables ever shrink.
    let max_attempts = count.saturating_mul(64).saturating_add(10_000);
    for _ in 0..max_attempts {
        if words.len() == count {
            break;
        }
        let word = random_word(&mut rng);
        if seen.insert(word.clone()) {
            words.push(word);
        }
    }
    if words.len() < count {
        return Err(TokenizerError::Build(format!(
            "found only {} distinct words of the {count} needed",
            words.len()
        )));
    }
    Ok(words)
}

/// One word: 1–4 consonant-vowel syllables, sometimes closed by a consonant.
fn random_word(rng: &mut ChaCha8Rng) -> String {
    // Mostly two- and three-syllable words, like "bamo" and "telisa".
    let syllables = match rng.next_u32() % 20 {
        0..=2 => 1,
        3..=10 => 2,
        11..=17 => 3,
        _ => 4,
    };
    let mut word = String::with_capacity(syllables * 3 + 1);
    for _ in 0..syllables {
        word.push_str(pick(rng, &ONSETS));
        word.push_str(pick(rng, &VOWELS));
    }
    if rng.next_u32() % 10 < 3 {
        word.push_str(pick(rng, &CODAS));
    }
    word
}

fn pick<'a>(rng: &mut ChaCha8Rng, table: &[&'a str]) -> &'a str {
    // Modulo bias is below 1e-8 for these table sizes; irrelevant here.
    table[rng.next_u32() as usize % table.len()]
}

/// The `tokenizer.json` document for the given words.
fn tokenizer_json(words: &[String]) -> Value {
    let mut vocab = Map::with_capacity(FIXED_TOKENS + words.len());
    let glue = glue_chars().map(|c| format!("##{}", char::from(c)));
    let fixed = SPECIAL_TOKENS.iter().chain(PUNCTUATION.iter());
    for (id, token) in fixed
        .map(|t| t.to_string())
        .chain(glue)
        .chain(words.iter().cloned())
        .enumerate()
    {
        vocab.insert(token, json!(id));
    }
    let added_tokens: Vec<Value> = SPECIAL_TOKENS
        .iter()
        .enumerate()
        .map(|(id, content)| {
            json!({
                "id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true,
            })
        })
        .collect();
    let bos = SPECIAL_TOKENS[BOS_ID as usize];
    // WordPiece joins tokens with a space (no word starts with its "##"
    // continuation prefix); one Replace per mark then pulls punctuation back
    // onto the word before it. Both act per token, so incremental decoding
    // sees the same text as a full decode.
    let mut decoders = vec![json!({"type": "WordPiece", "prefix": "##", "cleanup": false})];
    decoders.extend(
        PUNCTUATION.iter().map(
            |p| json!({"type": "Replace", "pattern": {"String": format!(" {p}")}, "content": p}),
        ),
    );
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": {"type": "Lowercase"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Whitespace"},
            {"type": "Punctuation", "behavior": "Isolated"},
        ]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
            ],
            "pair": [
                {"SpecialToken": {"id": bos, "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": bos, "type_id": 1}},
                {"Sequence": {"id": "B", "type_id": 1}},
            ],
            "special_tokens": {bos: {"id": bos, "ids": [BOS_ID], "tokens": [bos]}},
        },
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": SPECIAL_TOKENS[UNK_ID as usize]},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_unique_lowercase_and_seed_dependent() {
        let a = generate_words(2000, 7).unwrap();
        let b = generate_words(2000, 7).unwrap();
        let c = generate_words(2000, 8).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_eq!(a.iter().collect::<HashSet<_>>().len(), 2000);
        assert!(a
            .iter()
            .all(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase())));
    }
}
