//! The tokenizer stored in a GGUF file's metadata, rebuilt as the Hugging
//! Face `tokenizer.json` the model came with.
//!
//! The metadata holds `tokenizer.ggml.model`, the vocabulary
//! (`tokenizer.ggml.tokens`, `token_type`, and `merges` or `scores`), the
//! special ids and `tokenizer.chat_template`. From them this module writes
//! the components of an HF `tokenizer.json` and lets the `tokenizers` crate
//! parse it, so encoding runs through exactly the code a `tokenizer.json`
//! does:
//! - `gpt2`: byte-level BPE from `tokens` + `merges`; the pre-tokenizer
//!   depends on `tokenizer.ggml.pre` (llama.cpp's name for the model's
//!   split regex) and is the one the model's own `tokenizer.json` has:
//!   `smollm` (digits one by one, then GPT-2's split), `gpt-2`/`default`,
//!   `llama-bpe` (Llama 3), `qwen2`. Another name is an error naming the key.
//! - `llama`: SentencePiece BPE with byte fallback, as transformers' GGUF
//!   converter builds it: merges derived from the scores (each piece split
//!   every way into two pieces of the vocabulary, ordered by the merged
//!   piece's score), `▁` for spaces, a `▁` prepended unless
//!   `tokenizer.ggml.add_space_prefix` is false.
//!
//! Token types (`token_type`): 2 (unknown) and 3 (control) become special
//! added tokens, 4 (user-defined) plain added tokens: all three are matched
//! whole in the text, as llama.cpp does; specials are skipped on decode.
//!
//! BOS, the EOS set (`eos`, `eot`, `eom` ids) and `add_bos_token` (default:
//! true for `llama`, false for `gpt2`, as llama.cpp) go to [`Tokenizer`]'s
//! own fields, so no post-processor is written.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::{json, Value as Json};

use super::Tokenizer;
use crate::gguf::{GgufError, GgufFile};

/// GGUF token types (llama.cpp's `llama_token_type`).
const TYPE_UNKNOWN: i64 = 2;
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// Llama 3's split (`tokenizer.ggml.pre` = `llama-bpe`).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split: Llama 3's with single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

impl Tokenizer {
    /// The tokenizer of a GGUF file (see the module doc).
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer, GgufError> {
        let json = tokenizer_json(file)?;
        let inner: tokenizers::Tokenizer = serde_json::from_value(json).map_err(|e| {
            GgufError::bad_meta(
                "tokenizer.ggml.model",
                format!("rejected by tokenizers: {e}"),
            )
        })?;
        let id = |key: &str| -> Result<Option<u32>, GgufError> {
            Ok(file.opt_usize(key)?.map(|v| v as u32))
        };
        let model = file.str("tokenizer.ggml.model")?;
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let mut eos = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            eos.extend(id(key)?);
        }
        let add_bos = file
            .opt_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(model == "llama");
        let template = file.opt_str("tokenizer.chat_template")?.map(str::to_owned);
        Ok(Tokenizer::from_parts(inner, bos, eos, add_bos)?.with_chat_template(template))
    }

    /// Opens (memory-maps) a GGUF file and reads its tokenizer.
    pub fn from_gguf_path(path: &Path) -> Result<Tokenizer, GgufError> {
        Self::from_gguf(&GgufFile::open(path)?)
    }
}

/// The HF `tokenizer.json` equivalent of the GGUF metadata.
pub fn tokenizer_json(file: &GgufFile) -> Result<Json, GgufError> {
    let model = file.str("tokenizer.ggml.model")?;
    let tokens = file.str_array("tokenizer.ggml.tokens")?;
    if tokens.is_empty() {
        return Err(GgufError::bad_meta("tokenizer.ggml.tokens", "is empty"));
    }
    let types = match file.get("tokenizer.ggml.token_type") {
        None => vec![1; tokens.len()],
        Some(_) => file.i64_array("tokenizer.ggml.token_type")?,
    };
    if types.len() != tokens.len() {
        return Err(GgufError::bad_meta(
            "tokenizer.ggml.token_type",
            format!("{} entries for {} tokens", types.len(), tokens.len()),
        ));
    }
    let added = added_tokens(&tokens, &types);
    // Later duplicates win, as in transformers' `{tok: i for i, tok in ...}`.
    let vocab: serde_json::Map<String, Json> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), json!(i)))
        .collect();
    let (normalizer, pre_tokenizer, decoder, model_json) = match model {
        "gpt2" => {
            let merges = file
                .str_array("tokenizer.ggml.merges")?
                .into_iter()
                .map(|m| {
                    m.split_once(' ')
                        .map(|(a, b)| json!([a, b]))
                        .ok_or_else(|| {
                            GgufError::bad_meta(
                                "tokenizer.ggml.merges",
                                format!("merge {m:?} has no space"),
                            )
                        })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let pre = file.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
            let (normalizer, pre_tokenizer, decoder, ignore_merges) = bpe_components(pre)?;
            let model = json!({
                "type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": "", "end_of_word_suffix": "",
                "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges,
                "vocab": vocab, "merges": merges,
            });
            (normalizer, pre_tokenizer, decoder, model)
        }
        "llama" => {
            let scores = file.f32_array("tokenizer.ggml.scores")?;
            if scores.len() != tokens.len() {
                return Err(GgufError::bad_meta(
                    "tokenizer.ggml.scores",
                    format!("{} entries for {} tokens", scores.len(), tokens.len()),
                ));
            }
            let unk = match file.opt_usize("tokenizer.ggml.unknown_token_id")? {
                Some(i) => Some(*tokens.get(i).ok_or_else(|| {
                    GgufError::bad_meta(
                        "tokenizer.ggml.unknown_token_id",
                        format!("{i} is outside the {} tokens", tokens.len()),
                    )
                })?),
                None => types
                    .iter()
                    .position(|&t| t == TYPE_UNKNOWN)
                    .map(|i| tokens[i]),
            };
            let prefix = file
                .opt_bool("tokenizer.ggml.add_space_prefix")?
                .unwrap_or(true);
            let merges = merges_from_scores(&tokens, &scores);
            let mut normalizers = Vec::new();
            if prefix {
                normalizers.push(json!({"type": "Prepend", "prepend": "\u{2581}"}));
            }
            normalizers.push(
                json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}),
            );
            let mut decoders = vec![
                json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
                json!({"type": "ByteFallback"}),
                json!({"type": "Fuse"}),
            ];
            if prefix {
                decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
            }
            let model = json!({
                "type": "BPE", "dropout": null, "unk_token": unk,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": vocab, "merges": merges,
            });
            (
                json!({"type": "Sequence", "normalizers": normalizers}),
                Json::Null,
                json!({"type": "Sequence", "decoders": decoders}),
                model,
            )
        }
        other => {
            return Err(GgufError::bad_meta(
                "tokenizer.ggml.model",
                format!("unsupported tokenizer model `{other}` (supported: gpt2, llama)"),
            ))
        }
    };
    Ok(json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": decoder,
        "model": model_json,
    }))
}

/// Unknown and control tokens as special added tokens, user-defined ones as
/// plain added tokens.
fn added_tokens(tokens: &[&str], types: &[i64]) -> Vec<Json> {
    tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (_, &t))| matches!(t, TYPE_UNKNOWN | TYPE_CONTROL | TYPE_USER_DEFINED))
        .map(|(id, (content, &t))| {
            json!({
                "id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": t != TYPE_USER_DEFINED,
            })
        })
        .collect()
}

/// Normalizer, pre-tokenizer, decoder and `ignore_merges` of a byte-level
/// BPE, by llama.cpp's pre-tokenizer name, as the models' own
/// `tokenizer.json` files have them.
fn bpe_components(pre: &str) -> Result<(Json, Json, Json, bool), GgufError> {
    let byte_level = |trim: bool, regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": trim, "use_regex": regex});
    let split = |pattern: &str| json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false});
    let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
    Ok(match pre {
        "default" | "gpt-2" | "gpt2" => (Json::Null, byte_level(true, true), decoder, false),
        "smollm" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": true},
                byte_level(true, true),
            ]}),
            decoder,
            false,
        ),
        "llama-bpe" | "llama3" => (
            Json::Null,
            json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(true, false)]}),
            decoder,
            true,
        ),
        "qwen2" => (
            json!({"type": "NFC"}),
            json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false, false)]}),
            byte_level(false, false),
            false,
        ),
        other => {
            return Err(GgufError::bad_meta(
                "tokenizer.ggml.pre",
                format!("unsupported pre-tokenizer `{other}` (supported: default, gpt-2, smollm, llama-bpe, qwen2)"),
            ))
        }
    })
}

/// SentencePiece BPE merges from piece scores, as transformers'
/// `GGUFTokenizerSkeleton` derives them: every split of every piece into two
/// pieces of the vocabulary, within a piece by the parts' scores
/// (descending), overall by the merged piece's score (descending, stable).
fn merges_from_scores(tokens: &[&str], scores: &[f32]) -> Vec<Json> {
    // Later duplicates win, as in the dict transformers builds.
    let mut score: HashMap<&str, f32> = HashMap::with_capacity(tokens.len());
    let mut order: Vec<&str> = Vec::with_capacity(tokens.len());
    for (t, &s) in tokens.iter().zip(scores) {
        if score.insert(t, s).is_none() {
            order.push(t);
        }
    }
    let known: HashSet<&str> = tokens.iter().copied().collect();
    let mut merges: Vec<(&str, &str, f32)> = Vec::new();
    for piece in order {
        let piece_score = score[piece];
        let mut local: Vec<(&str, &str, f32)> = piece
            .char_indices()
            .skip(1)
            .map(|(i, _)| piece.split_at(i))
            .filter(|(l, r)| known.contains(l) && known.contains(r))
            .map(|(l, r)| (l, r, piece_score))
            .collect();
        local.sort_by(|a, b| {
            (score[b.0], score[b.1])
                .partial_cmp(&(score[a.0], score[a.1]))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
        merges.extend(local);
    }
    merges.sort_by(|a, b| b.2.partial_cmp(&a.2).unwrap_or(std::cmp::Ordering::Equal));
    merges.into_iter().map(|(l, r, _)| json!([l, r])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::writer::GgufWriter;
    use crate::gguf::{Value, ValueType};

    /// A byte-level BPE GGUF: two control tokens, the 256 byte characters,
    /// digit merges `1 2`, `12 3`, `4 5`, and a user-defined `<tool>`.
    fn bpe_gguf(pre: Option<&str>, model: &str) -> GgufFile {
        let mut alphabet: Vec<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
            .into_iter()
            .collect();
        alphabet.sort();
        let mut tokens = vec!["<s>".to_string(), "</s>".to_string()];
        tokens.extend(alphabet.iter().map(|c| c.to_string()));
        tokens.extend(["12", "123", "45", "<tool>"].map(String::from));
        let mut types = vec![3, 3];
        types.extend(std::iter::repeat_n(1, tokens.len() - 3));
        types.push(4);
        let strings = |v: &[String]| {
            Value::Array(
                ValueType::String,
                v.iter().cloned().map(Value::String).collect(),
            )
        };
        let mut w = GgufWriter::new();
        w.kv("tokenizer.ggml.model", Value::String(model.into()))
            .kv("tokenizer.ggml.tokens", strings(&tokens))
            .kv(
                "tokenizer.ggml.token_type",
                Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
            )
            .kv(
                "tokenizer.ggml.merges",
                strings(&["1 2", "12 3", "4 5"].map(String::from)),
            )
            .kv("tokenizer.ggml.bos_token_id", Value::U32(0))
            .kv("tokenizer.ggml.eos_token_id", Value::U32(1));
        if let Some(pre) = pre {
            w.kv("tokenizer.ggml.pre", Value::String(pre.into()));
        }
        GgufFile::from_bytes(w.to_bytes()).unwrap()
    }

    fn pieces(t: &Tokenizer, text: &str) -> Vec<String> {
        t.encode_plain(text)
            .unwrap()
            .into_iter()
            .map(|id| t.inner().id_to_token(id).unwrap())
            .collect()
    }

    #[test]
    fn bpe_pre_tokenizers_split_digits_as_their_models_do() {
        let cases = [
            (None, vec!["123", "45"]),
            (Some("gpt-2"), vec!["123", "45"]),
            (Some("llama-bpe"), vec!["123", "45"]),
            (Some("smollm"), vec!["1", "2", "3", "4", "5"]),
            (Some("qwen2"), vec!["1", "2", "3", "4", "5"]),
        ];
        for (pre, expected) in cases {
            let t = Tokenizer::from_gguf(&bpe_gguf(pre, "gpt2")).unwrap();
            assert_eq!(pieces(&t, "12345"), expected, "pre {pre:?}");
            // Llama 3 groups digits by three.
            if pre == Some("llama-bpe") {
                assert_eq!(pieces(&t, "1234512"), ["123", "45", "1", "2"]);
            }
            // User-defined tokens are matched whole but are not special.
            assert_eq!(pieces(&t, "a<tool>b"), ["a", "<tool>", "b"], "pre {pre:?}");
            let ids = t.encode_plain("<s>x<tool>").unwrap();
            assert_eq!(ids[0], 0, "control tokens are matched in the text");
            assert_eq!(
                t.decode(&ids).unwrap(),
                "x<tool>",
                "specials skipped on decode"
            );
            assert!(!t.inner().get_added_vocabulary().is_special_token("<tool>"));
            assert_eq!((t.bos_id(), t.eos_ids()), (Some(0), &[1][..]));
            assert_eq!(
                t.encode("x").unwrap(),
                t.encode_plain("x").unwrap(),
                "gpt2: no BOS by default"
            );
        }
    }

    #[test]
    fn unsupported_tokenizers_name_the_key() {
        let e = Tokenizer::from_gguf(&bpe_gguf(Some("tekken"), "gpt2"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer.ggml.pre") && e.contains("tekken"),
            "{e}"
        );
        let e = Tokenizer::from_gguf(&bpe_gguf(None, "bert"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tokenizer.ggml.model") && e.contains("bert"),
            "{e}"
        );
        let e = Tokenizer::from_gguf(&GgufFile::from_bytes(GgufWriter::new().to_bytes()).unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("tokenizer.ggml.model"), "{e}");
    }

    #[test]
    fn spm_merges_follow_the_merged_piece_scores() {
        // By the merged piece's score; within "abc" by the parts' scores,
        // left part first (transformers' order): ("a", "bc") before ("ab", "c").
        let tokens = ["a", "b", "c", "ab", "bc", "abc"];
        let scores = [0.0, 0.0, 0.0, -1.0, -2.0, -3.0];
        let merges = merges_from_scores(&tokens, &scores);
        assert_eq!(
            merges,
            [
                json!(["a", "b"]),
                json!(["b", "c"]),
                json!(["a", "bc"]),
                json!(["ab", "c"])
            ]
        );
    }
}
