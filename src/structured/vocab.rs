//! The token trie llguidance needs: the exact bytes each token id
//! contributes to the output, built from a [`Tokenizer`].
//!
//! How a token's bytes are found, by tokenizer kind:
//! - **Byte-level BPE** (GPT-2, SmolLM2, Llama 3, Qwen): the piece's
//!   characters are GPT-2's printable stand-ins for bytes; each maps back to
//!   its byte, so a token holding half of a UTF-8 character yields exactly
//!   that half.
//! - **Byte fallback** (SentencePiece `<0xNN>` pieces): the byte `NN`.
//! - **Anything else** (SentencePiece `▁` pieces, the embedded word-level
//!   vocabulary): the text the tokenizer's own decoder gives the token after
//!   other text ([`Tokenizer::token_text`]), so `▁the` is `" the"` and the
//!   word-level `bamo` is `" bamo"`.
//! - **Special tokens** (added tokens marked special): `0xFF` followed by
//!   their content, toktrie's marker, so no grammar matches them as text;
//!   non-special added tokens are their content.
//!
//! Invariant (tested against each tokenizer's decode): for ids without
//! special tokens, the concatenated bytes equal what the tokenizer decodes
//! them to after a leading context, so a grammar that accepts the bytes
//! accepts the text the client receives.

use llguidance::toktrie::{TokRxInfo, TokTrie};

use crate::tokenizer::Tokenizer;

/// The bytes of every token id of `tokenizer`, in id order (see the module
/// docs for the rules).
pub fn token_bytes(tokenizer: &Tokenizer) -> Vec<Vec<u8>> {
    let inner = tokenizer.inner();
    let decoder = inner
        .get_decoder()
        .and_then(|d| serde_json::to_value(d).ok())
        .unwrap_or_default();
    let byte_level = has_type(&decoder, "ByteLevel");
    let byte_fallback = has_type(&decoder, "ByteFallback");
    let unicode_to_byte = gpt2_unicode_to_byte();
    let added = inner.get_added_tokens_decoder();
    (0..tokenizer.vocab_size() as u32)
        .map(|id| {
            if let Some(token) = added.get(&id) {
                let mut bytes = Vec::with_capacity(token.content.len() + 1);
                if token.special {
                    bytes.push(TokTrie::SPECIAL_TOKEN_MARKER);
                }
                bytes.extend_from_slice(token.content.as_bytes());
                return bytes;
            }
            let Some(piece) = inner.id_to_token(id) else {
                return Vec::new();
            };
            if byte_level {
                if let Some(bytes) = piece
                    .chars()
                    .map(|c| unicode_to_byte.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                {
                    return bytes;
                }
            }
            if byte_fallback {
                if let Some(b) = fallback_byte(&piece) {
                    return vec![b];
                }
            }
            tokenizer
                .token_text(id)
                .map(String::into_bytes)
                .unwrap_or_default()
        })
        .collect()
}

/// The trie of `tokenizer`'s tokens; `eos` is the id a grammar allows when
/// it may end.
pub fn token_trie(tokenizer: &Tokenizer, eos: u32) -> TokTrie {
    let words = token_bytes(tokenizer);
    let mut info = TokRxInfo::new(words.len() as u32, eos);
    info.tok_bos = tokenizer.bos_id();
    TokTrie::from(&info, &words)
}

/// Whether a serialised decoder (or one in its `Sequence`) has this `type`.
fn has_type(decoder: &serde_json::Value, kind: &str) -> bool {
    match decoder {
        serde_json::Value::Object(map) => {
            map.get("type").and_then(|t| t.as_str()) == Some(kind)
                || map.values().any(|v| has_type(v, kind))
        }
        serde_json::Value::Array(items) => items.iter().any(|v| has_type(v, kind)),
        _ => false,
    }
}

/// `<0xNN>` → `NN`.
fn fallback_byte(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// GPT-2's byte ↔ printable-character table, inverted: printable Latin-1
/// bytes stand for themselves, the other 68 bytes for U+0100 onwards.
fn gpt2_unicode_to_byte() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                let c = char::from_u32(next).expect("U+0100..U+0143 are chars");
                next += 1;
                c
            };
            (c, b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::word_level_tokenizer;

    /// The bytes of `ids` joined, against the tokenizer's decode of them
    /// after a context token (decoders treat a sequence's first token
    /// specially).
    fn assert_bytes_match_decode(tokenizer: &Tokenizer, context: u32, ids: &[u32]) {
        let bytes = token_bytes(tokenizer);
        let joined: Vec<u8> = ids
            .iter()
            .flat_map(|&t| bytes[t as usize].clone())
            .collect();
        let head = tokenizer.decode(&[context]).unwrap();
        let mut all = vec![context];
        all.extend_from_slice(ids);
        let full = tokenizer.decode(&all).unwrap();
        let tail = full.strip_prefix(&head).expect("decode extends its prefix");
        assert_eq!(String::from_utf8_lossy(&joined), tail, "ids {ids:?}");
    }

    #[test]
    fn gpt2_table_is_a_bijection() {
        let t = gpt2_unicode_to_byte();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'Ġ'], b' ');
        assert_eq!(t[&'Ċ'], b'\n');
        assert_eq!(t[&'a'], b'a');
    }

    #[test]
    fn fallback_bytes_parse() {
        assert_eq!(fallback_byte("<0x0A>"), Some(10));
        assert_eq!(fallback_byte("<0xE2>"), Some(0xE2));
        assert_eq!(fallback_byte("<0x0>"), None);
        assert_eq!(fallback_byte("0x0A"), None);
    }

    #[test]
    fn word_level_bytes_match_its_decode() {
        let tok = word_level_tokenizer(2000, 7).unwrap();
        let bytes = token_bytes(&tok);
        assert_eq!(
            bytes[0][0],
            TokTrie::SPECIAL_TOKEN_MARKER,
            "<unk> is special"
        );
        let ids: Vec<u32> = (3..2000).step_by(37).collect();
        assert_bytes_match_decode(&tok, 20, &ids);
    }

    /// SmolLM2's byte-level BPE, from `tokenizer.json` and from the GGUF:
    /// every token's bytes, joined, are the decoded text (multi-byte
    /// characters split across tokens included), and the special tokens
    /// carry the marker.
    #[test]
    fn byte_level_bytes_match_smollm2_decode() {
        let Some(dir) = crate::testing::shared("models/smollm2-135m-instruct") else {
            return;
        };
        let from_dir = Tokenizer::from_dir(&dir).unwrap();
        let file =
            crate::gguf::GgufFile::open(&dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
        let from_gguf = Tokenizer::from_gguf(&file).unwrap();
        for tok in [&from_dir, &from_gguf] {
            let bytes = token_bytes(tok);
            assert_eq!(bytes[2], b"\xFF<|im_end|>".to_vec());
            for text in [
                "Hello, world! {\"a\": [1, 2.5e-3]}\n\tindent",
                "Ünïcödé — 日本語 😀 mixed",
            ] {
                let ids = tok.encode_plain(text).unwrap();
                let joined: Vec<u8> = ids
                    .iter()
                    .flat_map(|&t| bytes[t as usize].clone())
                    .collect();
                assert_eq!(String::from_utf8(joined).unwrap(), text);
            }
            let ids: Vec<u32> = (17..49152).step_by(97).collect();
            assert_bytes_match_decode(tok, 100, &ids);
        }
    }
}
